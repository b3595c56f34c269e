"""The `model` group's schema: one decoder (`ModelConfig`), its LoRA adapters and its
mixture-of-experts MLPs; model families differ only by these fields (presets in
configs/model/).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from gpurl.config.checks import DTYPES, ConfigError
from gpurl.config.checks import choice as _choice, positive as _positive, tuplify as _tuplify


@dataclass(frozen=True)
class LoraConfig:
    """LoRA (Hu et al. 2021): low-rank adapters on chosen projections train; the base is frozen."""

    rank: int = 0  # adapter rank r; 0 = LoRA off (full fine-tuning)
    alpha: float = 16.0  # adapters are scaled by alpha / rank (PEFT's lora_alpha)
    dropout: float = 0.0  # dropout on each adapter's input in training steps (PEFT's lora_dropout)
    # projections to adapt: globs (fnmatch, whole path) or regexes (re.search) over paths like
    # "blocks/3/attn/q" or "blocks/0/mlp/down" (attn q, k, v, o; mlp gate, up, down); ["*"] = all
    targets: list[str] = field(default_factory=lambda: ["*"])

    def __post_init__(self) -> None:
        _tuplify(self)
        _positive("model.lora.rank", self.rank, allow_zero=True)
        _positive("model.lora.alpha", self.alpha)
        if not 0.0 <= self.dropout < 1.0:
            raise ConfigError(f"model.lora.dropout={self.dropout} is not valid; set it in [0, 1).")
        if self.rank and not self.targets:
            raise ConfigError("model.lora.targets is empty; name the projections to adapt, "
                              "e.g. model.lora.targets='[*]' for all of them.")


@dataclass(frozen=True)
class MoEConfig:
    """Mixture-of-experts MLPs (Qwen3-MoE): a router picks `experts_per_token` of
    `num_experts` SwiGLU experts for every token; 0 experts = a dense model."""

    num_experts: int = 0  # experts of a sparse layer (HF num_experts); 0 = dense MLPs only
    experts_per_token: int = 2  # experts each token is routed to, top-k (HF num_experts_per_tok)
    expert_mlp_dim: int = 64  # hidden width of one expert (HF moe_intermediate_size)
    norm_topk_prob: bool = True  # renormalize the top-k router probabilities to sum to 1
    sparse_step: int = 1  # layer i is sparse iff (i + 1) % sparse_step == 0 (HF decoder_sparse_step)
    dense_layers: list[int] = field(default_factory=list)  # layers with a dense MLP of model.mlp_dim (HF mlp_only_layers)
    # load-balancing loss (Switch Transformer eq. 4-6, as transformers' load_balancing_loss_func);
    # null = 0.001 (Qwen3's router_aux_loss_coef) for sft and rm, 0 for RL and preference
    # algorithms (verl's Megatron bridge turns load balancing off for RL)
    aux_loss_coef: Optional[float] = None
    z_loss_coef: float = 0.0  # router z-loss, mean logsumexp(router logits)^2 (ST-MoE, Zoph et al. 2022: 0.001)
    # the train step routes completion tokens to the experts the sampler chose for them
    # (so it scores the policy that sampled); prompt tokens route as usual
    replay_routing: bool = False
    # training's expert parallelism: a device runs at most this many times its even share of
    # its expert group's token copies and drops the rest, its highest experts' first (GShard /
    # Switch Transformer capacity; dropped copies add nothing, logged as moe/dropped);
    # 0 = never drop (buffers for every copy); sampling never drops
    capacity_factor: float = 0.0
    # the experts' grouped matmul: auto (pallas on GPU, ragged on TPU, tiled on CPU),
    # pallas (Triton kernels over the tiled layout: only routed rows, each tile reading its
    # expert's weight; Pallas's interpreter off GPU), tiled (jnp: tokens sorted by expert in
    # fixed-size tiles, one expert per tile, each tile copying its expert's weight), ragged
    # (jax.lax.ragged_dot, which XLA's GPU and CPU compilers expand into a matmul of every
    # token with every expert: E x the flops)
    grouped_matmul: str = "auto"

    def __post_init__(self) -> None:
        _tuplify(self)
        _positive("model.moe.num_experts", self.num_experts, allow_zero=True)
        for key in ("experts_per_token", "expert_mlp_dim", "sparse_step"):
            _positive(f"model.moe.{key}", getattr(self, key))
        _positive("model.moe.z_loss_coef", self.z_loss_coef, allow_zero=True)
        _positive("model.moe.capacity_factor", self.capacity_factor, allow_zero=True)
        if self.aux_loss_coef is not None:
            _positive("model.moe.aux_loss_coef", self.aux_loss_coef, allow_zero=True)
        _choice("model.moe.grouped_matmul", self.grouped_matmul, ("auto", "pallas", "ragged", "tiled"))
        if self.num_experts and self.experts_per_token > self.num_experts:
            raise ConfigError(f"model.moe.experts_per_token={self.experts_per_token} exceeds "
                              f"model.moe.num_experts={self.num_experts}; route each token to "
                              f"at most num_experts experts.")

    def is_sparse(self, layer: int) -> bool:
        """Whether `layer` has experts (else a dense MLP)."""
        return (self.num_experts > 0 and layer not in self.dense_layers
                and (layer + 1) % self.sparse_step == 0)


@dataclass(frozen=True)
class VisionConfig:
    """A vision-language model's image side (Gemma 3 4B and up): a SigLIP vision tower whose
    patch states are pooled to `tokens` image tokens per image and projected to the
    language model's width; those replace the image's soft tokens in the text. A
    checkpoint's config.json (`vision_config`, `mm_tokens_per_image`, the token ids) sets
    these; `layers: 0` is a text-only model."""

    layers: int = 0  # encoder blocks of the tower (HF vision_config.num_hidden_layers); 0 = no vision
    width: int = 1152  # tower width (hidden_size)
    heads: int = 16  # tower attention heads
    mlp_dim: int = 4304  # tower MLP width (intermediate_size)
    image_size: int = 896  # pixels per side the images are resized to
    patch: int = 14  # pixels per patch side
    eps: float = 1e-6  # LayerNorm epsilon (layer_norm_eps), also the projector's RMSNorm's
    tokens: int = 256  # image tokens per image, a square number (mm_tokens_per_image)
    image_token_id: int = 262144  # the soft token each image token takes in the text (image_token_index)
    boi_token_id: int = 255999  # the token before an image's soft tokens (boi_token_index)
    eoi_token_id: int = 256000  # the token after them (eoi_token_index)
    # train the tower and projector too; false (default): they stay as loaded (optim.freeze
    # gains ^vision/), as most VLM RL recipes keep the encoder frozen
    trainable: bool = False

    def __post_init__(self) -> None:
        for key in ("width", "heads", "mlp_dim", "image_size", "patch", "tokens"):
            _positive(f"model.vision.{key}", getattr(self, key))
        _positive("model.vision.layers", self.layers, allow_zero=True)


@dataclass(frozen=True)
class ModelConfig:
    """One decoder; families differ only by these fields (presets in configs/model/)."""

    name: str = "tiny"  # preset name (see configs/model/)
    family: str = "gemma"  # architecture family (a file of gpurl/models/families/): gemma, gemma2, gemma3, llama, qwen2, qwen3, qwen3_moe
    checkpoint: Optional[str] = None  # Hugging Face Hub id (org/name or org/name@revision), HF safetensors dir or .gguf file; null = model.hub_id, else the preset's packaged weights (gemma3_270m: the GGUF package), else random where model.init allows
    hub_id: Optional[str] = None  # the preset's published weights on the Hub (gemma2b: google/gemma-2b), fetched into the Hub cache when model.checkpoint is null (docs/getting-started.md)
    vocab_size: int = 512  # rows of the embedding (>= the tokenizer's vocabulary)
    d_model: int = 64  # residual width D
    num_layers: int = 2  # decoder blocks L
    num_heads: int = 4  # query heads H
    num_kv_heads: int = 2  # key/value heads K (H % K == 0; K < H is GQA, K = 1 is MQA)
    head_dim: int = 16  # width of one head
    mlp_dim: int = 128  # hidden width of the gated MLP
    activation: str = "gelu_tanh"  # gate activation: gelu_tanh (GeGLU) or silu (SwiGLU)
    norm_eps: float = 1e-6  # RMSNorm epsilon
    norm_plus_one: bool = True  # RMSNorm scales by (1 + w) with w initialized at 0 (Gemma); else by w
    post_norms: bool = False  # extra RMSNorm after attention and after the MLP (Gemma 2/3)
    qk_norm: bool = False  # RMSNorm over each query and key head (Gemma 3, Qwen 3)
    qkv_bias: bool = False  # biases on the q, k, v projections (Qwen 2.5)
    tie_embeddings: bool = True  # output projection shares the embedding matrix
    scale_embeddings: bool = True  # multiply embeddings by sqrt(D) (Gemma)
    query_pre_attn_scalar: Optional[float] = None  # attention scale is this ** -0.5; null = head_dim
    attn_softcap: Optional[float] = None  # cap * tanh(logits / cap) on attention logits (Gemma 2)
    final_softcap: Optional[float] = None  # the same on output logits (Gemma 2)
    sliding_window: Optional[int] = None  # local layers attend to this many tokens; null = all global
    global_every: int = 1  # layer i is global iff (i + 1) % global_every == 0 (Gemma 2: 2, Gemma 3: 6)
    rope_theta: float = 10000.0  # RoPE base (global layers)
    rope_local_theta: Optional[float] = None  # RoPE base of sliding-window layers; null = rope_theta
    rope_scaling: str = "none"  # RoPE scaling of global layers: none, linear (Gemma 3 4B+), llama3
    rope_scaling_factor: float = 1.0  # linear/llama3: context extension factor
    rope_low_freq_factor: float = 1.0  # llama3 scaling: low-frequency factor
    rope_high_freq_factor: float = 4.0  # llama3 scaling: high-frequency factor
    rope_original_max_len: int = 8192  # llama3 scaling: original pre-training context length
    max_seq_len: int = 2048  # longest sequence the model is used with
    dtype: str = "auto"  # compute dtype: auto (float32 on CPU, bfloat16 on GPU), float32, bfloat16, float16 (GPUs without bf16; dynamic loss scaling)
    param_dtype: str = "float32"  # dtype of stored parameters and optimizer moments
    attention: str = "auto"  # attention kernel: auto (cudnn, else pallas, on GPU; xla on CPU), xla, cudnn, pallas
    init_std: float = 0.02  # std of the random normal init of projections
    # where the weights come from: checkpoint (model.checkpoint, or the preset's packaged
    # weights; without either the run stops: the real-model presets), random (drawn from
    # train.seed: tests, benchmarks), or auto (a checkpoint when there is one, else random)
    init: str = "auto"
    # what the backward pass keeps of each layer (the rest is recomputed): auto (full on
    # accelerators, none on CPU), none, full (only the layer's input), dots (matmul outputs
    # too), qkv (the q, k, v projections too)
    remat: str = "auto"
    # how the rollout's programs (prefill, decode) run the layers: auto (unrolled on GPU,
    # scan on CPU), unrolled (the rollout's copy holds each layer's weights as arrays of
    # their own, read in place: XLA's GPU programs copy a stacked layer's weights out before
    # each matmul, 3x a decode step's weight traffic; longer compiles), scan (one layer
    # compiled, run over the stack)
    sampling_layers: str = "auto"
    tokenizer: str = "auto"  # auto (the checkpoint's, else bytes), bytes (built-in byte-level), or a tokenizer.json path
    lora: LoraConfig = field(default_factory=LoraConfig)  # LoRA adapters (model.lora.rank > 0 turns them on)
    moe: MoEConfig = field(default_factory=MoEConfig)  # mixture-of-experts MLPs (model.moe.num_experts > 0 turns them on)
    vision: VisionConfig = field(default_factory=VisionConfig)  # a vision tower (model.vision.layers > 0 turns it on; a vision-language checkpoint sets it)

    def __post_init__(self) -> None:
        for key in ("vocab_size", "d_model", "num_layers", "num_heads", "num_kv_heads",
                    "head_dim", "mlp_dim", "max_seq_len", "global_every"):
            _positive(f"model.{key}", getattr(self, key))
        if self.num_heads % self.num_kv_heads:
            raise ConfigError(
                f"model.num_heads={self.num_heads} is not a multiple of model.num_kv_heads="
                f"{self.num_kv_heads}; choose num_kv_heads dividing num_heads.")
        _choice("model.activation", self.activation, ("gelu_tanh", "silu"))
        _choice("model.rope_scaling", self.rope_scaling, ("none", "linear", "llama3"))
        _choice("model.dtype", self.dtype, ("auto",) + DTYPES)
        _choice("model.param_dtype", self.param_dtype, DTYPES)
        _choice("model.attention", self.attention, ("auto", "xla", "cudnn", "pallas"))
        _choice("model.init", self.init, ("auto", "checkpoint", "random"))
        _choice("model.remat", self.remat, ("auto", "none", "full", "dots", "qkv"))
        _choice("model.sampling_layers", self.sampling_layers, ("auto", "unrolled", "scan"))
        bad = [i for i in self.moe.dense_layers if not 0 <= i < self.num_layers]
        if bad:
            raise ConfigError(f"model.moe.dense_layers names layers {bad} outside 0..{self.num_layers - 1}; "
                              f"list layers of the model.")
        if self.moe.num_experts and self.lora.rank and not all(
                self.moe.is_sparse(i) for i in range(self.num_layers)):
            raise ConfigError("LoRA on a mixture-of-experts model with dense layers "
                              "(model.moe.dense_layers or sparse_step > 1) is not supported; use "
                              "full fine-tuning or a model whose layers are all sparse.")
        v = self.vision
        if v.layers and max(v.image_token_id, v.boi_token_id, v.eoi_token_id) >= self.vocab_size:
            raise ConfigError(f"model.vision's token ids ({v.image_token_id}, {v.boi_token_id}, "
                              f"{v.eoi_token_id}) must be below model.vocab_size="
                              f"{self.vocab_size}; raise vocab_size or set the ids.")
        if self.init == "random" and self.checkpoint is not None:  # (a preset's hub_id is not)
            raise ConfigError(f"model.init=random draws random weights but model.checkpoint="
                              f"{self.checkpoint} is set; drop one of the two.")

    def is_global(self, layer: int) -> bool:
        """Whether `layer` attends to the whole context (else to `sliding_window` tokens)."""
        return self.sliding_window is None or (layer + 1) % self.global_every == 0
