"""Block sizes of the verify megakernel, the VMEM they cost, and the chips it targets.

`BlockSizes` says how much of each weight matrix, of the committed KV and of the
vocabulary one streamed tile holds. `vmem_buffers` lists every VMEM buffer the
kernel allocates for a given configuration (the kernel builds its scratch from the
same list, so the estimate is the allocation, not a guess); `default_block_sizes`
picks the largest tiles whose buffers fit a VMEM budget.

Worked example (Qwen3-8B shape, bf16, one sequence with a 64-node tree, so
`rows = 80`): `proj_cols = out_rows = 512`, `mlp_cols = 256`, `vocab_cols = 1024`,
`kv_rows = 512` stream 4 MiB tiles of wq/wk/wv/wo, 2 MiB tiles of each of
w_gate/w_up/w_down and 8 MiB LM-head tiles, double-buffered: 44 MiB of weight
buffers plus ~9 MiB of activations, inside TPU7x's 64 MiB per TensorCore.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np

from specdec.kernels.config import ModelConfig
from specdec.kernels.megakernel import collectives

MIB = 1024 * 1024
LANES = 128  # TPU vector lane count: minor dims of streamed tiles are multiples of it
VMEM_HEADROOM = 3 * MIB  # left free for Mosaic's internal scratch and spills


@dataclasses.dataclass(frozen=True)
class Chip:
    """What the roofline and the VMEM budget need to know about one TPU generation."""

    name: str  # topology prefix, e.g. "tpu7x" in "tpu7x:2x2x1"
    vmem_bytes: int  # VMEM per TensorCore (one JAX device)
    hbm_bytes_per_s: float  # HBM bandwidth per chip
    cores_per_chip: int  # TensorCores per chip; on TPU7x each is its own JAX device
    hbm_bytes: int  # HBM capacity per chip (each JAX device holds its share)
    ici_bytes_per_s: float = 0.0  # bidirectional inter-chip interconnect bandwidth per chip

    @property
    def hbm_bytes_per_device(self) -> int:
        return self.hbm_bytes // self.cores_per_chip


GIB = 1024 * MIB
# Each chip's published VMEM, HBM bandwidth, TensorCores, HBM capacity and ICI
# bandwidth (bidirectional, per chip): the vendor's specification sheets (Cloud TPU
# v6e / v5e pages) and, for TPU7x's ICI, Google's Ironwood announcement. Not
# measurements.
CHIPS = {
    "tpu7x": Chip("tpu7x", 64 * MIB, 7.37e12, 2, 192 * GIB, 1.2e12),
    "v6e": Chip("v6e", 128 * MIB, 1.64e12, 1, 32 * GIB, 0.8e12),
    "v5e": Chip("v5e", 128 * MIB, 0.82e12, 1, 16 * GIB, 0.4e12),
}


def chip_for_topology(topology: str) -> Chip:
    """`"tpu7x:2x2x1"` -> CHIPS["tpu7x"]; unknown generations raise ValueError."""
    name = topology.split(":", 1)[0].lower()
    if name not in CHIPS:
        raise ValueError(
            f"Unknown TPU generation {name!r} in topology {topology!r}; known: {sorted(CHIPS)}."
        )
    return CHIPS[name]


@dataclasses.dataclass(frozen=True)
class BlockSizes:
    """Tile sizes of the streamed operands (all static; a new value recompiles).

    On a real TPU every column count must be a multiple of 128 (the lane width) or the
    whole dimension; interpret mode accepts any divisor, which lets tiny test models
    exercise several tiles per matrix.
    """

    proj_cols: int = 256  # wq / wk / wv columns per tile; divides num_kv_heads * head_dim
    out_rows: int = 256  # wo rows (whole heads) per tile; divides num_heads * head_dim
    mlp_cols: int = 256  # intermediate columns per tile (w_gate, w_up cols; w_down rows)
    vocab_cols: int = 512  # LM-head columns per tile; a shorter last tile covers the rest
    kv_rows: int = 512  # committed cache positions per attention tile
    weight_ring: int = 2  # VMEM tiles of the qkv / o / LM-head rings (ring - 1 in flight)
    mlp_ring: int = 2  # VMEM tiles of the MLP ring (gate + up + down per tile)
    vmem_limit_bytes: int | None = None  # Mosaic's VMEM limit; None = the compiler default

    def __post_init__(self):
        for field in ("proj_cols", "out_rows", "mlp_cols", "vocab_cols", "kv_rows"):
            value = getattr(self, field)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"BlockSizes.{field} must be a positive integer, got {value!r}.")
        for field in ("weight_ring", "mlp_ring"):
            value = getattr(self, field)
            if not isinstance(value, int) or value < 2:
                raise ValueError(
                    f"BlockSizes.{field} must be an integer >= 2 (a tile computing while the "
                    f"next arrives), got {value!r}."
                )
        if self.vmem_limit_bytes is not None and self.vmem_limit_bytes < MIB:
            raise ValueError(
                f"BlockSizes.vmem_limit_bytes must be at least 1 MiB, got {self.vmem_limit_bytes}."
            )

    def validate(self, cfg: ModelConfig, *, max_len: int, tpu: bool) -> None:
        """Raises ValueError unless these tiles fit `cfg` (and TPU layouts when `tpu`)."""
        hd, kv_cols = cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        ffn, ffn_name = mlp_width(cfg)
        rules = [
            ("proj_cols", kv_cols, f"num_kv_heads * head_dim = {kv_cols}"),
            ("mlp_cols", ffn, f"{ffn_name} = {ffn}"),
        ]
        q_rows = cfg.num_heads * hd
        if cfg.is_mla:  # `megakernel.mla`: the two first products; wo rows of v-wide heads
            qa, kvw = mla_widths(cfg)
            rules[0] = ("proj_cols", math.gcd(qa, kvw), f"gcd(q columns {qa}, kv columns {kvw})")
            hd, q_rows = cfg.v_head_dim, cfg.num_heads * cfg.v_head_dim
        if q_rows % self.out_rows or self.out_rows % hd:
            raise ValueError(
                f"BlockSizes.out_rows ({self.out_rows}) must be a multiple of head_dim ({hd}) "
                f"dividing num_heads * head_dim = {q_rows}."
            )
        for field, dim, what in rules:
            value = getattr(self, field)
            if dim % value:
                raise ValueError(f"BlockSizes.{field} ({value}) must divide {what}.")
            if tpu and value % LANES and value != dim:
                raise ValueError(
                    f"BlockSizes.{field} ({value}) must be a multiple of {LANES} on TPU "
                    f"(or all of {what})."
                )
        if tpu and self.proj_cols % LANES:  # wq tiles start at multiples of proj_cols
            raise ValueError(
                f"BlockSizes.proj_cols ({self.proj_cols}) must be a multiple of {LANES} on TPU "
                f"(num_kv_heads * head_dim = {kv_cols}); use kernel='xla' for this model."
            )
        if self.proj_cols % cfg.head_dim:
            raise ValueError(
                f"BlockSizes.proj_cols ({self.proj_cols}) must be a multiple of head_dim "
                f"({cfg.head_dim})."
            )
        if cfg.is_hybrid:
            kd, vd, _ = cfg.linear_dims
            dv = cfg.linear_value_head_dim
            if kd % self.proj_cols or vd % self.proj_cols:
                raise ValueError(
                    f"BlockSizes.proj_cols ({self.proj_cols}) must divide the linear layers' "
                    f"key width ({kd}) and value width ({vd}) on each device."
                )
            if vd % self.out_rows or self.out_rows % dv:
                raise ValueError(
                    f"BlockSizes.out_rows ({self.out_rows}) must be a multiple of "
                    f"linear_value_head_dim ({dv}) dividing the value width ({vd})."
                )
        if self.vocab_cols > cfg.vocab_size:
            raise ValueError(
                f"BlockSizes.vocab_cols ({self.vocab_cols}) must be at most vocab_size "
                f"({cfg.vocab_size})."
            )
        if self.kv_rows > max_len:
            raise ValueError(
                f"BlockSizes.kv_rows ({self.kv_rows}) must be at most the cache length ({max_len})."
            )
        if tpu:
            if self.vocab_cols % LANES or cfg.vocab_size % LANES:
                raise ValueError(
                    f"On TPU BlockSizes.vocab_cols ({self.vocab_cols}) and vocab_size "
                    f"({cfg.vocab_size}) must be multiples of {LANES}; use kernel='xla'."
                )
            if self.kv_rows % 16:
                raise ValueError(f"BlockSizes.kv_rows ({self.kv_rows}) must be a multiple of 16.")


def mlp_width(cfg: ModelConfig) -> tuple[int, str]:
    """The MLP width the MLP tiles must divide: each expert's for a MoE model (and the
    greatest common divisor with its shared experts' and dense layers' widths)."""
    if not cfg.is_moe:
        return cfg.intermediate_size, "intermediate_size"
    widths = {"moe_intermediate_size": cfg.moe_intermediate_size}
    if cfg.shared_intermediate:
        widths["the shared experts' width"] = cfg.shared_intermediate
    if cfg.first_k_dense_replace:
        widths["intermediate_size"] = cfg.intermediate_size
    if len(widths) == 1:
        return cfg.moe_intermediate_size, "moe_intermediate_size"
    names = ", ".join(f"{k} = {v}" for k, v in widths.items())
    return math.gcd(*widths.values()), f"the gcd of {names}"


def mla_widths(cfg: ModelConfig) -> tuple[int, int]:
    """Columns of an MLA layer's two streamed first products (`megakernel.mla`): the
    query's (q_lora_rank, or all heads' queries) and wkv_a's padded to whole lanes."""
    qa = cfg.q_lora_rank or cfg.num_heads * (cfg.qk_nope_head_dim + cfg.head_dim)
    return qa, round_up(cfg.kv_lora_rank + cfg.head_dim, LANES)


def sublane_tile(dtype) -> int:
    """Rows of one VMEM tile: 8 for 32-bit, 16 for 16-bit dtypes (TPU packing)."""
    return 8 * max(1, 4 // np.dtype(dtype).itemsize)


def round_up(x: int, m: int) -> int:
    return -(-x // m) * m


def block_rows(num_nodes: int, dtype) -> int:
    """Rows per sequence in the kernel: root + nodes, padded to the sublane tile.

    64 nodes in bf16 -> 65 rows -> 80; 8 nodes in f32 -> 9 -> 16.
    """
    return round_up(num_nodes + 1, sublane_tile(dtype))


def padded_bytes(shape: tuple[int, ...], dtype) -> int:
    """VMEM bytes of a buffer: its two minor dims padded to (sublane tile, 128)."""
    itemsize = np.dtype(dtype).itemsize
    if len(shape) == 1:
        shape = (1, *shape)
    *lead, rows, cols = shape
    return math.prod(lead) * round_up(rows, sublane_tile(dtype)) * round_up(cols, LANES) * itemsize


@dataclasses.dataclass(frozen=True)
class Buffer:
    name: str
    shape: tuple[int, ...]
    dtype: np.dtype
    kind: str  # "input" (a VMEM operand), "output", or "scratch"

    @property
    def bytes(self) -> int:
        return padded_bytes(self.shape, self.dtype)


def vmem_buffers(
    cfg: ModelConfig,
    bs: BlockSizes,
    *,
    batch: int,
    num_nodes: int,
    weight_dtype,
    cache_dtype,
    tp: int = 1,
) -> list[Buffer]:
    """Every VMEM buffer of the kernel, in the order the kernel declares its scratch.

    `cfg` is what one device computes (`shard.local_config`); with `tp` > 1 devices
    the all-reduce and argmax-exchange buffers are added (`collectives`).
    """
    wdt, cdt = np.dtype(weight_dtype), np.dtype(cache_dtype)
    f32, i32 = np.dtype(np.float32), np.dtype(np.int32)
    np_ = block_rows(num_nodes, wdt)
    m = batch * np_
    d, hd, L = cfg.hidden_size, cfg.head_dim, cfg.num_layers
    h, k = cfg.num_heads, cfg.num_kv_heads
    qd, kvd = h * hd, k * hd
    mla = cfg.is_mla
    # Attention widths: a head's query / key, and its output (MLA: c + r, then v).
    ahd = cfg.kv_lora_rank + hd if mla else hd
    ohd = cfg.v_head_dim if mla else hd
    tv, ring = bs.vocab_cols, bs.weight_ring
    head_tile = (tv, d) if cfg.tie_word_embeddings else (d, tv)
    bufs = [
        Buffer("cos", (m, bs.proj_cols), f32, "input"),
        Buffer("sin", (m, bs.proj_cols), f32, "input"),
        Buffer("qpos", (m, 1), i32, "input"),
        Buffer("attn_mask", (batch, np_, np_), i32, "input"),
        Buffer("anc_mask", (batch, np_, np_), i32, "input"),
        Buffer("tree_cols", (m, 4), i32, "input"),
        Buffer("tree_rows", (batch, 2, np_), i32, "input"),
        Buffer("final_norm", (1, d), f32, "input"),
    ]
    if cfg.attention_bias:
        pc = bs.proj_cols  # one sublane row per tile: the kernel picks row j of tile j
        bufs += [
            Buffer("bq", (L, qd // pc, pc), f32, "input"),
            Buffer("bk", (L, kvd // pc, pc), f32, "input"),
            Buffer("bv", (L, kvd // pc, pc), f32, "input"),
        ]
    if cfg.qk_norm:
        la = cfg.num_cache_layers  # the attention layers'
        bufs += [Buffer("q_norm", (la, hd), f32, "input"), Buffer("k_norm", (la, hd), f32, "input")]
    if cfg.is_hybrid:
        lin = linear_buffers(cfg, batch=batch, np_=np_, weight_dtype=wdt)
        bufs += [buf for buf in lin if buf.kind == "input"]
    if cfg.is_mla:
        if cfg.q_lora_rank:
            bufs.append(Buffer("q_a_norm", (L, cfg.q_lora_rank), f32, "input"))
        bufs.append(Buffer("kv_a_norm", (L, cfg.kv_lora_rank), f32, "input"))
    if cfg.is_moe:
        bufs.append(Buffer("live", (m, 1), i32, "input"))
        if cfg.expert_bias:
            n_moe = cfg.num_layers - cfg.first_k_dense_replace
            bufs.append(Buffer("e_bias", (n_moe, cfg.num_experts), f32, "input"))
    bufs += [
        Buffer("verdict", (batch, 8, np_), i32, "output"),
        # scratch, in declaration order
        Buffer("x", (m, d), f32, "scratch"),  # residual stream
        Buffer("h", (m, d), wdt, "scratch"),  # normed residual, matmul input
        Buffer("q", (h, m, ahd), f32, "scratch"),  # head-major, RoPE applied
        Buffer("k", (k, m, ahd), f32, "scratch"),
        *([] if mla else [Buffer("v", (k, m, hd), f32, "scratch")]),
        Buffer("attn", (h, m, ohd), wdt, "scratch"),  # attention output, head-major
        Buffer("qkv_buf", (ring, d, bs.proj_cols), wdt, "scratch"),
        Buffer("o_buf", (ring, bs.out_rows, d), wdt, "scratch"),
        Buffer("gate_buf", (bs.mlp_ring, d, bs.mlp_cols), wdt, "scratch"),
        Buffer("up_buf", (bs.mlp_ring, d, bs.mlp_cols), wdt, "scratch"),
        Buffer("down_buf", (bs.mlp_ring, bs.mlp_cols, d), wdt, "scratch"),
        Buffer("head_buf", (ring, *head_tile), wdt, "scratch"),
        Buffer("logits_buf", (2, m, tv), f32, "scratch"),
        Buffer("kbuf", (2, bs.kv_rows, ahd), cdt, "scratch"),
        *([] if mla else [Buffer("vbuf", (2, bs.kv_rows, hd), cdt, "scratch")]),
        Buffer("rmw_buf", (kv_write_rows(num_nodes, cdt), ahd), cdt, "scratch"),
        Buffer("argmax", (m, 1), i32, "scratch"),
        Buffer("norms", (4, 1, d), f32, "scratch"),  # two layers' (attention, MLP) norms
    ]
    if mla:  # `megakernel.mla`: the two first products, latents, per-layer small weights
        c, nope, vd = cfg.kv_lora_rank, cfg.qk_nope_head_dim, cfg.v_head_dim
        qa, kvw = mla_widths(cfg)
        bufs += [
            Buffer("qa", (m, qa), f32, "scratch"),
            Buffer("kva", (m, kvw), f32, "scratch"),
            Buffer("olat", (h, m, c), f32, "scratch"),
            Buffer("wuk_buf", (h, c, nope), wdt, "scratch"),
            Buffer("wuv_buf", (h, c, vd), wdt, "scratch"),
        ]
        if cfg.q_lora_rank:
            bufs.append(Buffer("wqb_buf", (cfg.q_lora_rank, h * (nope + hd)), wdt, "scratch"))
    if cfg.attn_output_gate:
        bufs.append(Buffer("gate", (h, m, hd), f32, "scratch"))
    if cfg.is_hybrid:
        bufs += [buf for buf in lin if buf.kind == "scratch"]
    if cfg.is_moe:  # routed experts (`moe`): router weights, routing weights, union flags
        e = cfg.num_experts
        bufs += [
            Buffer("router_buf", (d, e), wdt, "scratch"),
            Buffer("route_w", (m, e), f32, "scratch"),
            Buffer("used_v", (1, e), i32, "scratch"),
        ]
    if tp > 1:
        chunk, owners = collectives.chunking(d, tp)
        bufs += [
            Buffer("red", (m, d), f32, "scratch"),  # this device's partial sum
            Buffer("scat", (tp, m, chunk), f32, "scratch"),  # reduce-scatter inbox
            Buffer("gath", (owners, m, chunk), f32, "scratch"),  # all-gather inbox
            Buffer("amx", (tp, m, LANES), f32, "scratch"),  # (max, argmax) per device
        ]
    return bufs


def linear_buffers(cfg: ModelConfig, *, batch: int, np_: int, weight_dtype) -> list[Buffer]:
    """A hybrid model's linear-layer VMEM buffers (`megakernel.hybrid`): inputs, then
    scratch; `cfg` is one device's part."""
    f32 = np.dtype(np.float32)
    m, d = batch * np_, cfg.hidden_size
    ll = len(cfg.linear_layers)
    taps = cfg.linear_conv_kernel_dim
    wrows = round_up(taps - 1, 8)
    kd, vd, c = cfg.linear_dims
    hv, dk, dv = cfg.linear_num_value_heads, cfg.linear_key_head_dim, cfg.linear_value_head_dim
    wdt = np.dtype(weight_dtype)
    return [
        Buffer("sel_block", (batch, taps - 1, np_, np_), f32, "input"),
        Buffer("sel_state", (batch, taps - 1, np_, wrows), f32, "input"),
        Buffer("lin_norm", (ll, dv), f32, "input"),
        Buffer("conv_q", (ll, taps, kd), f32, "input"),
        Buffer("conv_k", (ll, taps, kd), f32, "input"),
        Buffer("conv_v", (ll, taps, vd), f32, "input"),
        Buffer("a_log", (ll, hv), f32, "input"),
        Buffer("dt_bias", (ll, hv), f32, "input"),
        Buffer("lx", (m, c), f32, "scratch"),  # convolution inputs [q | k | v]
        Buffer("lz", (m, vd), f32, "scratch"),  # the output gate's input
        Buffer("lba", (m, 2 * hv), f32, "scratch"),  # b and a projections
        Buffer("lo", (hv, m, dv), wdt, "scratch"),  # mixer output, head-major
        Buffer("rk", (hv, m, dk), f32, "scratch"),  # record: keys per value head
        Buffer("ru", (hv, m, dv), f32, "scratch"),  # record: the delta rule's writes
        Buffer("rg", (m, LANES), f32, "scratch"),  # record: G, lane h = head h
        Buffer("ba_buf", (2, d, hv), wdt, "scratch"),
        Buffer("winq_buf", (batch, wrows, kd), f32, "scratch"),
        Buffer("wink_buf", (batch, wrows, kd), f32, "scratch"),
        Buffer("winv_buf", (batch, wrows, vd), f32, "scratch"),
        Buffer("s_buf", (2, hv, dk, dv), f32, "scratch"),
    ]


def kv_write_rows(num_nodes: int, cache_dtype) -> int:
    """Rows of the aligned window a 16-bit cache write rewrites (1 row when unused).

    A bf16 HBM slice must start and end on a 16-row boundary, so N + 1 new rows at an
    arbitrary offset need an aligned window of round_up(N + 16, 16) rows: 65 new rows
    -> 80.
    """
    if np.dtype(cache_dtype).itemsize >= 4:
        return 1
    align = sublane_tile(cache_dtype)
    return round_up(num_nodes + align, align)


def vmem_bytes(buffers: list[Buffer]) -> int:
    return sum(b.bytes for b in buffers)


def _largest_tile(dim: int, cap: int, quantum: int) -> int:
    """Largest multiple of `quantum` <= cap dividing dim; the whole dim if there is none."""
    best = 0
    for t in range(quantum, min(dim, cap) + 1, quantum):
        if dim % t == 0:
            best = t
    return best or dim


def _vocab_tile(vocab: int, cap: int) -> int:
    """min(cap, vocab) rounded down to a multiple of 128 (vocab itself when smaller)."""
    tile = min(cap, vocab)
    return tile - tile % LANES if tile >= LANES else tile


def default_block_sizes(
    cfg: ModelConfig,
    *,
    batch: int,
    num_nodes: int,
    weight_dtype,
    cache_dtype,
    max_len: int,
    vmem_budget: int = 48 * MIB,
    tp: int = 1,
    weight_ring: int = 2,
    mlp_ring: int = 2,
) -> BlockSizes:
    """The largest TPU-aligned tiles whose buffers (rings of `weight_ring` / `mlp_ring`
    tiles) fit `vmem_budget` bytes.

    Starts from 512-column weight tiles, 2048-column LM-head tiles and 512-row KV
    tiles, then halves the tile of the biggest ring until everything fits (or every
    tile is at its minimum, in which case the compiler gets the final word).
    """
    hd, kvd = cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    qd = cfg.num_heads * hd
    out_q = hd
    if cfg.is_mla:  # tiles shared by the two first products; wo rows of v-wide heads
        kvd = math.gcd(*mla_widths(cfg))
        qd, out_q = cfg.num_heads * cfg.v_head_dim, cfg.v_head_dim
    if cfg.is_hybrid:  # tiles shared with the linear layers' projections (`hybrid`)
        kd, vd, _ = cfg.linear_dims
        kvd = math.gcd(kvd, kd, vd)
        qd = math.gcd(qd, vd)
        out_q = math.lcm(hd, cfg.linear_value_head_dim)
    proj_q = math.lcm(hd, LANES)
    caps = {"proj_cols": 512, "out_rows": 512, "mlp_cols": 512, "vocab_cols": 2048}
    floor = {"proj_cols": proj_q, "out_rows": max(out_q, 16), "mlp_cols": LANES,
             "vocab_cols": LANES}  # fmt: skip

    def build(caps):
        kv_rows = min(512, max_len - max_len % 16) or max_len
        return BlockSizes(
            proj_cols=_largest_tile(kvd, max(caps["proj_cols"], proj_q), proj_q),
            out_rows=_largest_tile(qd, max(caps["out_rows"], out_q), out_q),
            mlp_cols=_largest_tile(mlp_width(cfg)[0], caps["mlp_cols"], LANES),
            vocab_cols=_vocab_tile(cfg.vocab_size, caps["vocab_cols"]),
            kv_rows=kv_rows,
            weight_ring=weight_ring,
            mlp_ring=mlp_ring,
        )

    def total(bs):
        return vmem_bytes(
            vmem_buffers(
                cfg, bs, batch=batch, num_nodes=num_nodes, weight_dtype=weight_dtype,
                cache_dtype=cache_dtype, tp=tp,
            )
        )  # fmt: skip

    bs = build(caps)
    stuck = set()  # tiles that cannot get smaller (no smaller divisor of the dimension)
    d = cfg.hidden_size
    while total(bs) > vmem_budget:
        sizes = {
            "proj_cols": weight_ring * d * bs.proj_cols,
            "out_rows": weight_ring * d * bs.out_rows,
            "mlp_cols": mlp_ring * 3 * d * bs.mlp_cols,
            "vocab_cols": weight_ring * d * bs.vocab_cols,
        }
        shrinkable = [f for f in sizes if f not in stuck and getattr(bs, f) > floor[f]]
        if not shrinkable:
            break
        field = max(shrinkable, key=sizes.get)
        trial_caps = dict(caps, **{field: getattr(bs, field) // 2})
        trial = build(trial_caps)
        if getattr(trial, field) >= getattr(bs, field):
            stuck.add(field)
            continue
        caps, bs = trial_caps, trial
    return bs


# VMEM kept back from the tiles' rings when choosing block sizes, for Mosaic's own
# use: a fixed part, plus ROW_TEMPORARIES f32 [rows, hidden] values (the residual
# updates' temporaries), which grow with the batch and the model width.
STREAM_RESERVE = 8 * MIB
ROW_TEMPORARIES = 2
# Weight bytes to keep in flight during the MLP stream (most of a layer's bytes). By
# Little's law a TensorCore streaming ~3.7 TB/s with DMAs taking a few microseconds
# needs several MiB outstanding; the published TPU7x megakernel keeps 24 MiB (12 x 2
# MiB buffers). The deepest ring tried is MAX_WEIGHT_RING.
IN_FLIGHT_TARGET = 24 * MIB
MAX_WEIGHT_RING = 12
# A chip's device_kind (as JAX reports it) -> its CHIPS entry.
DEVICE_KINDS = {"tpu7x": "tpu7x", "tpu v6 lite": "v6e", "tpu v6e": "v6e", "tpu v5 lite": "v5e"}
DEFAULT_CHIP = "tpu7x"  # what interpret mode on a CPU host sizes its tiles for


def chip_for_device(device) -> Chip:
    """The CHIPS entry of a JAX device; `DEFAULT_CHIP` for a device that is no TPU
    (interpret mode sizes tiles as the default target would)."""
    if device.platform != "tpu":
        return CHIPS[DEFAULT_CHIP]
    kind = device.device_kind.lower()
    if kind not in DEVICE_KINDS:
        raise ValueError(
            f"No tuning for TPU device kind {device.device_kind!r}; known: "
            f"{sorted(DEVICE_KINDS)}. Pass block_sizes explicitly."
        )
    return CHIPS[DEVICE_KINDS[kind]]


def step_block_sizes(
    cfg: ModelConfig,
    chip: Chip,
    *,
    batch: int,
    num_nodes: int,
    weight_dtype,
    cache_dtype,
    max_len: int,
    tp: int = 1,
) -> BlockSizes:
    """The block sizes and VMEM limit of the verify step on `chip`: the one choice the
    engine (`kernel.verify` without block sizes) and `specdec aot` both make, so the
    program compiled ahead of time is the one the engine runs. Tiles fit the chip's
    VMEM less the reserve above; the compiler's limit is the VMEM less `VMEM_HEADROOM`."""
    rows = batch * block_rows(num_nodes, weight_dtype)
    budget = chip.vmem_bytes - STREAM_RESERVE - ROW_TEMPORARIES * rows * cfg.hidden_size * 4
    best = None
    for weight_ring in range(2, 5):
        for mlp_ring in range(2, MAX_WEIGHT_RING + 1):
            bs = default_block_sizes(
                cfg, batch=batch, num_nodes=num_nodes, weight_dtype=weight_dtype,
                cache_dtype=cache_dtype, max_len=max_len, vmem_budget=budget, tp=tp,
                weight_ring=weight_ring, mlp_ring=mlp_ring,
            )  # fmt: skip
            used = vmem_bytes(
                vmem_buffers(cfg, bs, batch=batch, num_nodes=num_nodes,
                             weight_dtype=weight_dtype, cache_dtype=cache_dtype, tp=tp)
            )  # fmt: skip
            if used > budget and best is not None:
                break  # deeper rings fit no better
            ahead = weight_bytes_in_flight(cfg, bs, weight_dtype)
            others = min(ahead["qkv"], ahead["o"], ahead["head"])
            # MLP bytes in flight first (most of a layer), then the other streams', then
            # wider MLP tiles (fewer loop steps per byte).
            key = (
                min(ahead["mlp"], IN_FLIGHT_TARGET),
                min(others, IN_FLIGHT_TARGET // 4),
                bs.mlp_cols,
            )
            if best is None or key > best[0]:
                best = (key, bs)
            if ahead["mlp"] >= IN_FLIGHT_TARGET or mlp_ring > mlp_tiles(cfg, bs):
                break  # enough, or as deep as the MLP stream is long
    return dataclasses.replace(best[1], vmem_limit_bytes=chip.vmem_bytes - VMEM_HEADROOM)


def mlp_tiles(cfg: ModelConfig, bs: BlockSizes) -> int:
    """MLP tiles one layer streams: a MoE layer's for its experts' expected union at
    one row (k experts; more rows route to more)."""
    if cfg.is_moe:
        return cfg.moe_intermediate_size // bs.mlp_cols * cfg.num_experts_per_tok
    return cfg.intermediate_size // bs.mlp_cols


def weight_bytes_in_flight(cfg: ModelConfig, bs: BlockSizes, weight_dtype) -> dict[str, int]:
    """Bytes of weight DMAs outstanding while each stream computes a tile: the
    `weight_ring - 1` tiles ahead of it (`ops.stream`). `cfg` is one device's part."""
    d, item = cfg.hidden_size, np.dtype(weight_dtype).itemsize
    qkv_cols = (cfg.num_heads + 2 * cfg.num_kv_heads) * cfg.head_dim
    o_rows = cfg.num_heads * cfg.head_dim
    if cfg.is_mla:
        qkv_cols, o_rows = sum(mla_widths(cfg)), cfg.num_heads * cfg.v_head_dim
    tile = {  # (elements per tile, tiles per stream)
        "qkv": (d * bs.proj_cols, qkv_cols // bs.proj_cols),
        "o": (bs.out_rows * d, o_rows // bs.out_rows),
        "mlp": (3 * d * bs.mlp_cols, mlp_tiles(cfg, bs)),  # gate, up, down
        "head": (d * min(bs.vocab_cols, cfg.vocab_size), -(-cfg.vocab_size // bs.vocab_cols)),
    }
    out = {}
    for name, (elems, tiles) in tile.items():
        ring = bs.mlp_ring if name == "mlp" else bs.weight_ring
        out[name] = min(ring - 1, tiles) * elems * item  # a stream holds no more than its tiles
    return out
