"""`gpurl serve`: an OpenAI-compatible HTTP server (`gpurl.serve`) on the rollout engine of
a preset, a checkpoint, a Hub id or a gpurl run, on 127.0.0.1 with an API key.

The engine runs on this command's main thread, a scheduling iteration at a time: every
request that arrived joins the running batch (continuous batching), the prefix cache
serves the prefixes repeated calls share, and each finished call's answer goes back to
the server's event loop, which runs on a thread of its own (uvicorn). One process: the
server is for evaluation and agents' development; training serves agents through the
gateway of `env=agent` (docs/agents.md).
"""

from __future__ import annotations

import os
import secrets
import threading
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from gpurl.config import ConfigError, ServeConfig
from gpurl.distributed import layout, runtime
from gpurl.distributed.mesh import job_devices, rollout_mesh
from gpurl.models import loading, model_spec
from gpurl.rollout.decode import stop_token_ids
from gpurl.rollout.engine import Engine
from gpurl.serve.api import Defaults, Gateway
from gpurl.serve.app import Server, build_app
from gpurl.serve.driver import Driver
from gpurl.train.restore import restore_run


def serve_checks(cfg: ServeConfig, processes: int) -> list[str]:
    """The start-up checks a real start runs (and `gpurl check serve`)."""
    if processes > 1:
        raise ConfigError(f"gpurl serve runs as one process, not {processes}; start it "
                          f"without srun or distributed.num_processes.")
    if cfg.host not in ("127.0.0.1", "localhost", "::1"):
        print(f"[gpurl] serve: host={cfg.host} is reachable from the network; every request "
              f"still needs the API key.", flush=True)
    return [f"serve: http://{cfg.host}:{cfg.port}/v1, tool calls in the {cfg.tool_format} format"]


def build(cfg: ServeConfig) -> tuple[Gateway, Any, str]:
    """(the gateway over a loaded engine, the parameters, the model's name)."""
    if cfg.checkpoint is not None:
        run_cfg, params = restore_run(cfg.checkpoint)
        model_cfg = run_cfg.model
    else:
        model_cfg, params = loading.resolve(cfg.model), None
    tokenizer = loading.load_tokenizer(model_cfg)
    spec = model_spec(model_cfg)
    mesh = layout.for_sampling(cfg.mesh, spec, job_devices())
    stops = stop_token_ids(tokenizer, tuple(cfg.rollout.stop), not cfg.rollout.ignore_eos)
    engine = Engine(spec, cfg.rollout, rollout_mesh(mesh), cfg.mesh.sample_rules,
                    pad_id=tokenizer.pad_id, stop_ids=stops)
    if params is None:
        params = loading.load_params(model_cfg, spec, engine.stacked_shardings)
    if params is None:
        params = jax.jit(lambda: spec.init(cfg.seed), out_shardings=engine.stacked_shardings)()
    name = cfg.served_model_name or model_cfg.name
    r = cfg.rollout
    defaults = Defaults(r.temperature, r.top_p, r.top_k, r.max_new_tokens,
                        cfg.max_context or model_cfg.max_seq_len)
    gateway = Gateway(Driver(engine), tokenizer, stops, name, defaults, tuple(cfg.rollout.stop),
                      cfg.tool_format, rescore=Rescorer(engine, params))
    return gateway, params, name


class Rescorer:
    """The k likeliest tokens at each completion position, from one forward pass over the
    prompt and completion (the API's `top_logprobs`; the sampled token's own log-prob is
    the sampler's)."""

    def __init__(self, engine: Engine, params: Any):
        self.spec, self.params = engine.spec, params
        self._fn = jax.jit(self._top, static_argnums=(3,))

    def _top(self, params: Any, tokens: jax.Array, length: jax.Array, k: int) -> tuple:
        t = tokens.shape[1]
        positions = jnp.arange(t, dtype=jnp.int32)[None]
        segments = (positions < length).astype(jnp.int32)
        logits = self.spec.apply(params, tokens, positions, segments)[0].astype(jnp.float32)
        return jax.lax.top_k(jax.nn.log_softmax(logits, axis=-1), k)

    def __call__(self, prompt: list[int], completion: list[int], k: int) -> list[list[tuple[int, float]]]:
        seq = prompt + completion
        width = 1 << max(4, (len(seq) - 1).bit_length())  # few shapes: powers of two
        tokens = np.zeros((1, width), np.int32)
        tokens[0, :len(seq)] = seq
        values, ids = (np.asarray(x) for x in self._fn(self.params, tokens, np.int32(len(seq)), k))
        start = len(prompt) - 1  # the logits at position p predict token p + 1
        return [[(int(i), float(v)) for i, v in zip(ids[p], values[p])]
                for p in range(start, start + len(completion))]


class Serving:
    """The server and its engine loop, on threads of their own: `with Serving(cfg) as s:`
    serves at `s.url` with key `s.key` until the block ends."""

    def __init__(self, cfg: ServeConfig):
        runtime.initialize(cfg.distributed)
        serve_checks(cfg, runtime.process_count())
        self.key = (cfg.api_key or os.environ.get("GPURL_API_KEY")
                    or f"gpurl-{secrets.token_urlsafe(24)}")
        self.given = bool(cfg.api_key or os.environ.get("GPURL_API_KEY"))
        self.gateway, self.params, self.name = build(cfg)
        self.server = Server(build_app(self.gateway, self.key), cfg.port, cfg.host)
        self.url = self.server.url
        self._stop = threading.Event()
        self._loop = threading.Thread(target=self._engine, daemon=True, name="gpurl-engine")
        self.error: BaseException | None = None

    def _engine(self) -> None:
        driver = self.gateway.driver
        try:
            while not self._stop.is_set():
                if not driver.step(self.params) and not driver.pending():
                    driver.wait(0.05)
        except BaseException as e:  # noqa: BLE001 - reported by `serve`, the server stops
            self.error = e
            self.server.server.should_exit = True

    def use(self, params: Any) -> None:
        """Serve `params` from the engine's next iteration on (new weights: a fine-tuned
        policy). The prefix cache keys blocks by a version that changes with them, so no
        block the old weights computed is served again."""
        self.params = self.gateway.rescore.params = params
        self.gateway.driver.version += 1

    def __enter__(self) -> "Serving":
        self.server.start()
        self._loop.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        self.gateway.driver.wait(0)
        self._loop.join(30)
        self.server.stop()


def serve(cfg: ServeConfig) -> None:
    """Serves until interrupted (Ctrl-C, SIGTERM)."""
    with Serving(cfg) as s:
        shown = "as given" if s.given else s.key
        print(f"[gpurl] serving {s.name} at {s.url} (OpenAI API; API key {shown}); Ctrl-C "
              f"stops it", flush=True)
        try:
            while s._loop.is_alive() and not s.server.server.should_exit:
                s._loop.join(0.5)
        except KeyboardInterrupt:
            pass
    if s.error is not None:
        raise s.error
    print("[gpurl] server stopped", flush=True)
