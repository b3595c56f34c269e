"""The compiler's account of a GPU program: the matmul flops and HBM bytes of its
optimized module, read from the text XLA's GPU compiler emits (`compiled.as_text()`).

XLA's own cost analysis (`hlo_module_cost_analysis`) counts a loop body once and a
scatter into the paged KV pool as reading and writing the whole pool, so it cannot say
what a decode step costs. This reads the same module and counts, per instruction the GPU
runs (a fusion is one kernel):
- bytes: the operands it reads and the result it writes; an operand a fusion only slices
  or gathers from counts as the slices it reads (a layer's weights out of the stack, the
  embedding rows of the tokens); an in-place update (dynamic-update-slice, scatter: the
  result shares the buffer) counts as its updates;
- flops: 2 x M x N x K of every dot, in a fusion or a cuBLAS call; cuDNN's attention
  4 x B x H x Sq x Sk x D forward (half under a causal mask; its backward 2.5x that);
- loops: a body times XLA's `known_trip_count`; the outermost loop without one is the
  unit of work of a program that repeats one (the decode chunk's decode step);
- Pallas kernels by what they do: the paged decode attention reads a row's live blocks
  of the pool (`Hints.kv_tokens` per row), not the pool it is handed.
Element-wise flops are not counted (a matmul's are three or more orders larger). It is
the compiler's account, never a measurement: no autotuning without a GPU, and what a
kernel reads twice from L2 counts once here.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from typing import Iterator

from gpurl.models.moe import EXPERT_DISPATCH

DTYPE_BYTES = {"pred": 1, "s4": 0.5, "u4": 0.5, "s8": 1, "u8": 1, "f8e4m3fn": 1, "f8e5m2": 1,
               "bf16": 2, "f16": 2, "s16": 2, "u16": 2, "f32": 4, "s32": 4, "u32": 4,
               "f64": 8, "s64": 8, "u64": 8, "c64": 8, "token": 0}
# Instructions that move no data: tuples, views, constants, the ends of asynchronous pairs.
FREE = {"parameter", "get-tuple-element", "tuple", "bitcast", "constant", "after-all",
        "partition-id", "replica-id", "opt-barrier", "add-dependency", "domain",
        "all-gather-done", "all-reduce-done", "collective-permute-done", "copy-done",
        "async-done", "send-done", "recv-done", "iota"}
COLLECTIVES = ("all-gather", "all-reduce", "reduce-scatter", "all-to-all", "collective-permute",
               "ragged-all-to-all")
SLICES = {"slice", "dynamic-slice", "gather"}
IN_PLACE = {"dynamic-update-slice", "scatter"}

_ARRAY = re.compile(r"([a-z][a-z0-9]*)\[([0-9,]*)\]")
_LINE = re.compile(r"^\s*(ROOT\s+)?%(\S+)\s*=\s*(.*)$")
_HEADER = re.compile(r"^(ENTRY\s+)?%(\S+)\s*\(.*\{\s*$")
_CALLED = re.compile(r"\b(calls|body|condition|to_apply)=%([\w.\-]+)")
_BRANCHES = re.compile(r"branch_computations=\{([^}]*)\}")
_TRIP = re.compile(r'"known_trip_count":\{"n":"(\d+)"\}')
_ONE_LAYER = re.compile(r"_\d+_(\.\d+)?$")  # a jit argument of one layer: `..._q___3_.1`
_DIMS = re.compile(r"(lhs_contracting_dims|lhs_batch_dims)=\{([0-9,]*)\}")


@dataclass
class Array:
    dtype: str
    dims: tuple[int, ...]

    @property
    def bytes(self) -> float:
        return math.prod(self.dims) * DTYPE_BYTES.get(self.dtype, 4)


@dataclass
class Instr:
    name: str
    shape: list[Array]  # a tuple's leaves, or one array
    opcode: str
    operands: list[str]
    attrs: str
    root: bool = False
    index: int = -1  # a parameter's number

    @property
    def bytes(self) -> float:
        return sum(a.bytes for a in self.shape)

    def called(self, kind: str) -> str | None:
        m = re.search(rf"\b{kind}=%([\w.\-]+)", self.attrs)
        return m.group(1) if m else None


@dataclass
class Module:
    computations: dict[str, list[Instr]]
    entry: str

    def by_name(self, comp: str) -> dict[str, Instr]:
        return {i.name: i for i in self.computations[comp]}


def _closing(text: str, start: int) -> int:
    """The index of the parenthesis closing the one at `start`."""
    depth = 0
    for i in range(start, len(text)):
        depth += {"(": 1, ")": -1}.get(text[i], 0)
        if depth == 0:
            return i
    return len(text) - 1


def _instr(line: str) -> Instr | None:
    m = _LINE.match(line)
    if not m:
        return None
    root, name, rest = bool(m.group(1)), m.group(2), m.group(3)
    rest = re.sub(r"/\*.*?\*/", "", rest)
    if rest.startswith("("):
        end = _closing(rest, 0)
        type_text, rest = rest[:end + 1], rest[end + 1:].lstrip()
    else:
        type_text, _, rest = rest.partition(" ")
    shape = [Array(d, tuple(int(x) for x in dims.split(",") if x))
             for d, dims in _ARRAY.findall(type_text)]
    op = re.match(r"([\w\-]+)\(", rest)
    if not op:
        return None
    open_at = op.end() - 1
    close = _closing(rest, open_at)
    inside = rest[open_at + 1:close]
    operands = re.findall(r"%([\w.\-]+)", inside)
    index = int(inside) if op.group(1) == "parameter" and inside.isdigit() else -1
    return Instr(name, shape, op.group(1), operands, rest[close + 1:], root, index)


def parse(text: str) -> Module:
    """The computations of an HLO module's text, in order, with their instructions."""
    comps: dict[str, list[Instr]] = {}
    entry, current = "", None
    for line in text.splitlines():
        head = _HEADER.match(line)
        if head and not line.startswith(" "):
            current = head.group(2)
            comps[current] = []
            if head.group(1):
                entry = current
            continue
        if current is not None and line.startswith("  "):
            ins = _instr(line)
            if ins is not None:
                comps[current].append(ins)
    return Module(comps, entry)


@dataclass(frozen=True)
class Hints:
    """What the program's shapes cannot say: the tokens a paged-attention call reads per
    row (the live context, averaged over the layers: a sliding-window layer reads its
    window), and the query heads per KV head it serves."""

    kv_tokens: float = 0.0
    group: int = 0  # query heads per KV head (the kernel pads them to 16 rows); 0: as given
    # devices a packed row is split over (mesh.context): a flash call whose keys are its
    # queries times this is a context-split self-attention, causal like an unsplit one
    context: int = 1


@dataclass
class Cost:
    flops: float = 0.0
    bytes: float = 0.0
    by_kind: dict[str, float] = field(default_factory=dict)  # bytes by what moved them
    link: float = 0.0  # bytes one device sends or receives over the interconnect (collectives)
    expert_link: float = 0.0  # ... of which a mixture of experts' dispatch and combine

    def add(self, other: Cost, times: float = 1.0) -> None:
        self.flops += other.flops * times
        self.bytes += other.bytes * times
        self.link += other.link * times
        self.expert_link += other.expert_link * times
        for k, v in other.by_kind.items():
            self.by_kind[k] = self.by_kind.get(k, 0.0) + v * times

    def charge(self, kind: str, nbytes: float, flops: float = 0.0) -> None:
        self.bytes += nbytes
        self.flops += flops
        self.by_kind[kind] = self.by_kind.get(kind, 0.0) + nbytes


def _link_bytes(op: str, read: float, written: float) -> float:
    """Bytes a collective moves over the interconnect per device (an upper bound, as if
    the group were large): an all-gather receives what it did not hold (its output less
    its input; an async start's output holds both), a reduce-scatter sends what it does
    not keep, an all-reduce (a ring: reduce-scatter then all-gather) about twice its
    size, an all-to-all or a permute its whole buffer."""
    if op.startswith("all-gather"):
        return max(written - 2 * read, 0.0) if op.endswith("start") else max(written - read, 0.0)
    if op.startswith("reduce-scatter"):
        return max(read - written, 0.0)
    if op.startswith("all-reduce"):
        return 2.0 * read
    return read


def _dot_flops(ins: Instr, shapes: dict[str, list[Array]]) -> float:
    """2 x output elements x contracted size of a dot (HLO attributes)."""
    dims = dict(_DIMS.findall(ins.attrs))
    lhs = shapes[ins.operands[0]][0].dims
    contracted = math.prod(lhs[int(d)] for d in dims.get("lhs_contracting_dims", "").split(",") if d)
    return 2.0 * math.prod(ins.shape[0].dims) * contracted


def _gemm_flops(ins: Instr, shapes: dict[str, list[Array]]) -> float:
    """The same for a cuBLAS call (its `gemm_backend_config`)."""
    config = json.loads(_json_of(ins.attrs))
    numbers = config["gemm_backend_config"]["dot_dimension_numbers"]
    lhs = shapes[ins.operands[0]][0].dims
    contracted = math.prod(lhs[int(d)] for d in numbers.get("lhs_contracting_dimensions", []))
    return 2.0 * math.prod(ins.shape[0].dims) * contracted


def _json_of(attrs: str) -> str:
    """The JSON object of an instruction's `backend_config=`."""
    start = attrs.index("backend_config=") + len("backend_config=")
    depth = 0
    for i in range(start, len(attrs)):
        depth += {"{": 1, "}": -1}.get(attrs[i], 0)
        if depth == 0:
            return attrs[start:i + 1]
    return attrs[start:]


class Account:
    """Costs of a module's computations as a GPU runs them."""

    def __init__(self, text: str, hints: Hints = Hints()):
        self.module = parse(text)
        self.hints = hints
        self._shapes = {c: {i.name: i.shape for i in ins} for c, ins in self.module.computations.items()}
        self._costs: dict[str, Cost] = {}

    # ---------------------------------------------------------------- units of work

    def program(self) -> Cost:
        """One run of the whole program."""
        return self.computation(self.module.entry)

    def step(self) -> Cost | None:
        """One iteration of the outermost loop whose trip count is not known (a decode
        chunk's decode step), or None when the program has none."""
        for ins in self._walk(self.module.entry):
            if ins.opcode == "while" and not _TRIP.search(ins.attrs):
                cost = Cost()
                cost.add(self.computation(ins.called("body")))
                cost.add(self.computation(ins.called("condition")))
                return cost
        return None

    def float32_weights(self) -> list[str]:
        """The program's parameters (jit arguments named `params...`) it reads in float32,
        but for norm scales and the MoE router (read in float32 by design)."""
        return [f"{i.name}: {i.shape[0].dtype}{list(i.shape[0].dims)}"
                for i in self.module.computations[self.module.entry]
                if i.opcode == "parameter" and i.name.startswith("params")
                and i.shape and i.shape[0].dtype == "f32" and len(i.shape[0].dims) >= 2
                and not re.search(r"(scale|router)(_+\d+)?_*(\.\d+)?$", i.name)]

    def converted_weights(self) -> list[str]:
        """Converts inside the step's loop (the decode step) of an array shaped like one of
        the program's weights or one layer of them: a weight cast on every step."""
        weights = set()
        for i in self.module.computations[self.module.entry]:
            if i.opcode == "parameter" and i.name.startswith("params") and i.shape:
                dims = i.shape[0].dims
                if len(dims) >= 2:
                    weights.add(dims)
                # a stack of layers (not one layer's array, named `..._<layer>_`): its slices
                if len(dims) >= 3 and "blocks" in i.name and not _ONE_LAYER.search(i.name):
                    weights |= {dims[1:], (1,) + dims[1:]}
        loop = next((ins for ins in self._walk(self.module.entry)
                     if ins.opcode == "while" and not _TRIP.search(ins.attrs)), None)
        if loop is None:
            return []
        found = []
        for comp in self._reachable(loop.called("body")):
            shapes = self._shapes[comp]
            for ins in self.module.computations[comp]:
                if ins.opcode != "convert":
                    continue
                source = shapes.get(ins.operands[0], [])
                if source and source[0].dtype == "f32" and source[0].dims in weights:
                    found.append(f"{comp}/{ins.name}: f32{list(source[0].dims)} -> {ins.shape[0].dtype}")
        return found

    def _reachable(self, comp: str) -> list[str]:
        """`comp` and every computation it calls (loops, fusions, nested fusions)."""
        seen, todo = [], [comp]
        while todo:
            current = todo.pop()
            if current in seen or current not in self.module.computations:
                continue
            seen.append(current)
            for ins in self.module.computations[current]:
                todo += [c for _, c in _CALLED.findall(ins.attrs)]
        return seen

    def _walk(self, comp: str) -> Iterator[Instr]:
        """The instructions run by `comp`, outer ones first (into loops and calls)."""
        todo = [comp]
        while todo:
            current = todo.pop(0)
            for ins in self.module.computations[current]:
                yield ins
                if ins.opcode in ("while", "call", "conditional"):
                    todo += [c for _, c in _CALLED.findall(ins.attrs) if c in self.module.computations
                             and not c.startswith("fused")]

    # ------------------------------------------------------------------- costs

    def computation(self, comp: str) -> Cost:
        if comp not in self._costs:
            cost = Cost()
            shapes = self._shapes[comp]
            for ins in self.module.computations[comp]:
                self._instruction(ins, shapes, cost)
            self._costs[comp] = cost
        return self._costs[comp]

    def _instruction(self, ins: Instr, shapes: dict[str, list[Array]], cost: Cost) -> None:
        op = ins.opcode
        if op in FREE:
            return
        if op == "while":
            m = _TRIP.search(ins.attrs)
            trips = int(m.group(1)) if m else 1
            cost.add(self.computation(ins.called("body")), trips)
            cost.add(self.computation(ins.called("condition")), trips + 1)
            return
        if op == "call":
            cost.add(self.computation(ins.called("to_apply")))
            return
        if op == "conditional":
            names = [b.strip().lstrip("%") for b in _BRANCHES.search(ins.attrs).group(1).split(",")]
            branches = [self.computation(b) for b in names]
            cost.add(max(branches, key=lambda c: c.bytes))
            return
        reads = [a for name in ins.operands for a in shapes.get(name, [])]
        if op == "fusion":
            self._fusion(ins, shapes, cost)
        elif op == "custom-call":
            self._custom_call(ins, shapes, cost, reads)
        elif op in IN_PLACE:
            update = shapes[ins.operands[-1 if op == "scatter" else 1]]
            cost.charge("in-place updates", 2 * sum(a.bytes for a in update))
        elif op in SLICES:
            cost.charge("slices", 2 * ins.bytes)
        elif op.startswith(COLLECTIVES):
            moved = sum(a.bytes for a in reads) + ins.bytes
            cost.charge("collectives", moved)
            link = _link_bytes(op, sum(a.bytes for a in reads), ins.bytes)
            cost.link += link
            if EXPERT_DISPATCH in ins.attrs:
                cost.expert_link += link
        elif op == "dot":
            cost.charge("matmuls", sum(a.bytes for a in reads) + ins.bytes, _dot_flops(ins, shapes))
        else:
            cost.charge("copies" if op in ("copy", "copy-start", "transpose") else "other",
                        sum(a.bytes for a in reads) + ins.bytes)

    def _fusion(self, ins: Instr, shapes: dict[str, list[Array]], cost: Cost) -> None:
        comp = ins.called("calls")
        body = self.module.computations[comp]
        read = 0.0
        in_place = self._in_place_buffer(comp)
        for index, name in enumerate(ins.operands):
            if index == in_place:
                continue
            full = sum(a.bytes for a in shapes.get(name, []))
            read += min(full, self._parameter_reads(comp, index, full))
        if in_place is not None:
            written = self._update_bytes(comp)
        else:
            written = ins.bytes
        flops = self._fused_flops(comp)
        kind = ("matmuls" if flops else
                "in-place updates" if in_place is not None else
                "copies" if _is_copy(body) else "fusions")
        cost.charge(kind, read + written, flops)

    def _parameter(self, comp: str, index: int) -> Instr | None:
        return next((i for i in self.module.computations[comp]
                     if i.opcode == "parameter" and i.index == index), None)

    def _users(self, comp: str, name: str) -> list[Instr]:
        return [i for i in self.module.computations[comp] if name in i.operands]

    def _parameter_reads(self, comp: str, index: int, full: float) -> float:
        """Bytes a fused computation reads of its parameter `index`: the slices or gathered
        rows when it only slices it (through views and nested fusions), else all of it."""
        param = self._parameter(comp, index)
        if param is None:
            return full
        return self._reads_of(comp, param.name, full)

    def _reads_of(self, comp: str, name: str, full: float) -> float:
        total = 0.0
        for user in self._users(comp, name):
            if user.opcode in ("slice", "dynamic-slice") and user.operands[0] == name:
                total += user.bytes
            elif user.opcode == "gather" and user.operands[0] == name:
                total += user.bytes
            elif user.opcode == "bitcast":
                total += self._reads_of(comp, user.name, full)
            elif user.opcode == "fusion":
                inner = user.called("calls")
                for j, operand in enumerate(user.operands):
                    if operand == name:
                        total += self._parameter_reads(inner, j, full)
            elif user.opcode in IN_PLACE and user.operands[0] == name:
                continue  # the buffer updated in place
            else:
                return full
            if total >= full:
                return full
        return total

    def _in_place_buffer(self, comp: str) -> int | None:
        """The parameter a fusion updates in place (its root is a dynamic-update-slice or
        scatter into it, or a tuple of such into parameters), or None."""
        body = self.module.computations[comp]
        root = next((i for i in body if i.root), body[-1])
        if root.opcode in IN_PLACE:
            target = self.module.by_name(comp).get(root.operands[0])
            if target is not None and target.opcode == "parameter":
                return target.index
        return None

    def _update_bytes(self, comp: str) -> float:
        """Bytes written by a fusion's in-place root: twice its updates (read, write)."""
        body = self.module.computations[comp]
        root = next((i for i in body if i.root), body[-1])
        shapes = self._shapes[comp]
        update = shapes[root.operands[-1 if root.opcode == "scatter" else 1]]
        return 2 * sum(a.bytes for a in update)

    def _fused_flops(self, comp: str) -> float:
        flops = 0.0
        shapes = self._shapes[comp]
        for i in self.module.computations[comp]:
            if i.opcode == "dot":
                flops += _dot_flops(i, shapes)
            elif i.opcode == "fusion":
                flops += self._fused_flops(i.called("calls"))
        return flops

    def _custom_call(self, ins: Instr, shapes: dict[str, list[Array]], cost: Cost,
                     reads: list[Array]) -> None:
        target = re.search(r'custom_call_target="([^"]+)"', ins.attrs).group(1)
        moved = sum(a.bytes for a in reads) + ins.bytes
        if target.startswith("__cublas"):
            cost.charge("matmuls", moved, _gemm_flops(ins, shapes))
        elif target.startswith("__cudnn$fmha"):
            cost.charge("attention", moved, _cudnn_flops(ins, shapes, target))
        elif "gpurl_paged_decode" in ins.attrs:
            cost.charge("attention", *self._paged(ins, shapes))
        elif "gpurl_grouped_" in ins.attrs:
            cost.charge("matmuls", *_grouped(ins, shapes))
        elif "gpurl_flash" in ins.attrs:
            cost.charge("attention", moved, _flash_flops(ins, shapes, self.hints.context))
        else:
            cost.charge("other", moved)

    def _paged(self, ins: Instr, shapes: dict[str, list[Array]]) -> tuple[float, float]:
        """(bytes, flops) of the paged decode kernel: each row reads its live blocks of
        keys and values (the hint's tokens), its queries, and writes its output."""
        _, table, lengths, q, k_pool, _ = (shapes[o][0] for o in ins.operands)
        rows, kv_heads, group, head_dim = q.dims
        block = k_pool.dims[-3]
        tokens = math.ceil(self.hints.kv_tokens / block) * block if self.hints.kv_tokens else (
            table.dims[1] * block)
        kv = 2 * rows * tokens * kv_heads * head_dim * DTYPE_BYTES[k_pool.dtype]
        own = q.bytes + ins.bytes + rows * (table.dims[1] * 4 + 4)
        heads = kv_heads * (self.hints.group or group)  # useful flops, not the padded rows
        return kv + own, 4.0 * rows * heads * tokens * head_dim


def _is_copy(body: list[Instr]) -> bool:
    """A fusion that only moves data (slices, transposes, copies, converts)."""
    moving = {"parameter", "bitcast", "copy", "transpose", "slice", "dynamic-slice", "convert",
              "reshape", "broadcast", "concatenate", "pad", "tuple", "constant"}
    return all(i.opcode in moving for i in body)


def _cudnn_flops(ins: Instr, shapes: dict[str, list[Array]], target: str) -> float:
    """cuDNN's fused attention: 4 x B x H x Sq x Sk x D forward (Q K^T and P V), half with
    a causal mask; the backward recomputes the scores and runs three more matmuls: 2.5x."""
    q, k = shapes[ins.operands[0]][0].dims, shapes[ins.operands[1]][0].dims
    b, sq, h, d = q
    sk = k[1]
    flops = 4.0 * b * h * sq * sk * d
    if '"mask_type":"CAUSAL"' in ins.attrs.replace(" ", ""):
        flops /= 2
    return flops * (2.5 if target.endswith("Backward") else 1.0)


def _grouped(ins: Instr, shapes: dict[str, list[Array]]) -> tuple[float, float]:
    """(bytes, flops) of the Pallas grouped matmul kernels (`gpurl.kernels.pallas_grouped`)
    at the rows a balanced routing lays out (the kernel's name says how many; the tiles
    past them read nothing): `gpurl_grouped_mm` reads those rows of x, each expert's weight
    once (the other tiles of an expert read it from L2) and writes every tile;
    `gpurl_grouped_tmm` (the weight gradient) reads those rows of x and dy and writes the
    weights' gradient."""
    rows = float(re.search(r"gpurl_grouped_t?mm_rows(\d+)", ins.attrs).group(1))
    _, _, x, other = (shapes[o][0] for o in ins.operands)
    depth, item = x.dims[1], DTYPE_BYTES[x.dtype]
    if "gpurl_grouped_tmm" in ins.attrs:
        cols = other.dims[1]
        return rows * (depth + cols) * item + ins.bytes, 2.0 * rows * depth * cols
    cols = ins.shape[0].dims[1]
    return rows * depth * item + other.bytes + ins.bytes, 2.0 * rows * depth * cols


def _flash_flops(ins: Instr, shapes: dict[str, list[Array]], context: int = 1) -> float:
    """The Pallas flash kernels (gpurl_flash_fwd, _dq, _dkv; q B x T x H x D, keys B x S x
    K x D): a forward's 4 x B x H x T x S x D, half when causal (the kernel skips masked
    blocks; self-attention here is causal, split over `context` devices or not: a device's
    balanced share of a row sees half of the gathered keys), or the backward kernels' (dq
    recomputes the scores and runs dP and dQ: 1.5x; dkv the scores, dP, dV and dK: 2x)."""
    q, k = shapes[ins.operands[0]][0].dims, shapes[ins.operands[1]][0].dims
    if len(q) != 4 or len(k) != 4:
        return 0.0
    causal = q[1] == k[1] or (context > 1 and k[1] == q[1] * context)
    flops = 4.0 * math.prod(q) * k[1] / (2 if causal else 1)
    if "gpurl_flash_dq" in ins.attrs:
        return flops * 1.5
    if "gpurl_flash_dkv" in ins.attrs:
        return flops * 2.0
    return flops
