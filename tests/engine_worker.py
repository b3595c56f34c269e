"""One process of a rollout-engine run for tests/test_multiprocess.py: a tiny random model
generates this process's share of `REQUESTS` on a rollout mesh over every device of the
job, and writes its completions, the engine's scheduling iterations and the host gathers
the call made (`gpurl.distributed.host.counts`) as JSON.

usage: python engine_worker.py OUT.json [COORDINATOR PROCESSES ID]"""

from __future__ import annotations

import json
import sys

from gpurl.config import DistributedConfig, MeshConfig, ModelConfig, RolloutConfig
from gpurl.distributed import host, runtime
from gpurl.distributed.mesh import rollout_mesh
from gpurl.models import model_spec
from gpurl.rollout.engine import Engine
from gpurl.rollout.requests import Request

MODEL = {"vocab_size": 259, "d_model": 32, "num_layers": 2, "num_heads": 4, "num_kv_heads": 2,
         "head_dim": 8, "mlp_dim": 64, "dtype": "float32"}
# 16 requests of mixed lengths (4 per rollout shard); process p of 2 takes 8 of them
REQUESTS = [Request(tuple(range(1, 3 + i % 5)), 3 + (7 * i) % 11, seed=i) for i in range(16)]


def main() -> None:
    out, *job = sys.argv[1:]
    if job:
        runtime.initialize(DistributedConfig(coordinator=job[0], num_processes=int(job[1]),
                                             process_id=int(job[2])))
    spec = model_spec(ModelConfig(**MODEL))
    mesh = MeshConfig()
    engine = Engine(spec, RolloutConfig(slots=2, block_size=4, decode_chunk=3, temperature=1.0),
                    rollout_mesh(mesh), mesh.sample_rules, stop_ids=(0,), pad_id=0)
    count, rank = runtime.process_count(), runtime.process_index()
    per = len(REQUESTS) // count
    params = spec.init(0)
    before = host.counts["gather"]
    done = engine.generate(params, REQUESTS[rank * per:(rank + 1) * per])
    record = {"gathers": host.counts["gather"] - before,
              "iterations": engine.stats["iterations"], "chunks": engine.stats["chunks"],
              "tokens": [c.tokens.tolist() for c in done],
              "logprobs": [c.logprobs.tolist() for c in done]}
    with open(out, "w") as f:
        json.dump(record, f)


if __name__ == "__main__":
    main()
