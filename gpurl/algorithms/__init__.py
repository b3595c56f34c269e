"""Algorithms as pure objectives over arrays, one record each in `registry`.

GRPO, GSPO, DAPO, Dr. GRPO and RLOO are one objective (`grpo`) whose terms are chosen by
config; PPO adds a critic (`ppo`); DPO (with IPO / hinge / conservative losses), SimPO
and ORPO are pair losses (`dpo`); reward models train with Bradley-Terry (`rm`). The RL
math they share is in `policy_gradient`, the forward passes in `forward`. The presets in
configs/algo/ set each paper's values.
"""
