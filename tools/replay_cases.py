#!/usr/bin/env python3
"""Replay cases for pagedattn: an independent NumPy oracle of the attention contract.

A replay file captures one `forward` call (see docs/replay-format.md). This script

  * generates the committed test cases and their expected outputs:
        python tools/replay_cases.py --out tests/replay-cases
  * compares an output file produced by a backend with an expected file:
        python tools/replay_cases.py --check OUT.safetensors EXPECTED.safetensors
  * runs the oracle on any replay file (e.g. one captured from another engine):
        python tools/replay_cases.py --forward CASE.safetensors OUT.safetensors
  * checks itself (brute-force second implementation, exhaustive fp8 search):
        python tools/replay_cases.py --selftest

Only numpy and ml_dtypes are needed; safetensors files are read and written by hand.
"""

import argparse
import json
import math
import os
import struct
import sys
import zlib

import ml_dtypes
import numpy as np

BF16 = np.dtype(ml_dtypes.bfloat16)
F16 = np.dtype(np.float16)
F32 = np.dtype(np.float32)

# --------------------------------------------------------------------------------------------------
# safetensors, by hand
# --------------------------------------------------------------------------------------------------

_ST_NAMES = {
    "F64": np.dtype(np.float64), "F32": F32, "F16": F16, "BF16": BF16,
    "I64": np.dtype(np.int64), "I32": np.dtype(np.int32), "I16": np.dtype(np.int16),
    "I8": np.dtype(np.int8), "U8": np.dtype(np.uint8), "U16": np.dtype(np.uint16),
    "U32": np.dtype(np.uint32), "U64": np.dtype(np.uint64), "BOOL": np.dtype(np.bool_),
}
_ST_OF = {v: k for k, v in _ST_NAMES.items()}
_UINT_OF_SIZE = {1: "<u1", 2: "<u2", 4: "<u4", 8: "<u8"}


def _le_bytes(arr):
    """Raw little-endian bytes of a contiguous array (bf16 included)."""
    arr = np.ascontiguousarray(arr)
    raw = arr.view(np.dtype("u%d" % arr.dtype.itemsize)) if arr.dtype.itemsize > 1 else arr.view(np.uint8)
    return raw.astype(_UINT_OF_SIZE[arr.dtype.itemsize], copy=False).tobytes()


def write_safetensors(path, tensors, metadata=None):
    """Write {name: ndarray} with string metadata. Tensors are ordered like the official serializer
    (larger element size first, then by name), so every tensor is aligned to its element size."""
    names = sorted(tensors, key=lambda n: (-tensors[n].dtype.itemsize, n))
    header, blobs, off = {}, [], 0
    if metadata:
        assert all(isinstance(k, str) and isinstance(v, str) for k, v in metadata.items())
        header["__metadata__"] = dict(metadata)
    for n in names:
        a = tensors[n]
        if a.dtype not in _ST_OF:
            raise ValueError("unsupported dtype %s for %s" % (a.dtype, n))
        b = _le_bytes(a)
        header[n] = {"dtype": _ST_OF[a.dtype], "shape": [int(x) for x in a.shape],
                     "data_offsets": [off, off + len(b)]}
        blobs.append(b)
        off += len(b)
    h = json.dumps(header, separators=(",", ":")).encode("utf-8")
    h += b" " * (-len(h) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(h)))
        f.write(h)
        for b in blobs:
            f.write(b)


def read_safetensors(path):
    """Return ({name: ndarray}, {metadata}). Raises ValueError on a malformed file."""
    with open(path, "rb") as f:
        data = f.read()
    if len(data) < 8:
        raise ValueError("%s: too short for a safetensors file" % path)
    (hlen,) = struct.unpack("<Q", data[:8])
    if 8 + hlen > len(data):
        raise ValueError("%s: header length %d past end of file" % (path, hlen))
    header = json.loads(data[8:8 + hlen].decode("utf-8"))
    meta = header.pop("__metadata__", None) or {}
    body = memoryview(data)[8 + hlen:]
    out = {}
    for name, info in header.items():
        dt = _ST_NAMES.get(info["dtype"])
        if dt is None:
            raise ValueError("%s: tensor %s has unsupported dtype %s" % (path, name, info["dtype"]))
        b0, b1 = info["data_offsets"]
        shape = tuple(int(x) for x in info["shape"])
        if b1 - b0 != int(np.prod(shape, dtype=np.int64)) * dt.itemsize or b1 > len(body):
            raise ValueError("%s: tensor %s: data_offsets %s do not fit shape %s" % (path, name, [b0, b1], shape))
        raw = np.frombuffer(body[b0:b1], dtype=_UINT_OF_SIZE[dt.itemsize]).astype(
            np.dtype("u%d" % dt.itemsize) if dt.itemsize > 1 else np.uint8)
        out[name] = raw.view(dt).reshape(shape).copy()
    return out, meta


# --------------------------------------------------------------------------------------------------
# number formats
# --------------------------------------------------------------------------------------------------

FP8 = {
    "fp8_e4m3": (np.dtype(ml_dtypes.float8_e4m3fn), 448.0),
    "fp8_e5m2": (np.dtype(ml_dtypes.float8_e5m2), 57344.0),
}


def fp8_encode(x, kind):
    """float32 array -> uint8 codes: round to nearest even, saturate to +-max (inf too), NaN -> 0x7F,
    the sign of zero kept."""
    dt, fmax = FP8[kind]
    x = np.asarray(x, dtype=np.float32)
    nan = np.isnan(x)
    c = np.clip(np.where(nan, np.float32(0), x), np.float32(-fmax), np.float32(fmax))
    codes = c.astype(dt).view(np.uint8).copy()
    codes[nan] = 0x7F
    return codes


def fp8_decode(codes, kind):
    """uint8 codes -> float64 values."""
    dt, _ = FP8[kind]
    return np.asarray(codes, dtype=np.uint8).view(dt).astype(np.float64)


def quantize(x, scale, kind):
    """Cache store of a K or V element of any float dtype: fp8(float32(x) / float32(scale))."""
    q = np.asarray(x).astype(np.float32) / np.float32(scale)
    return fp8_encode(q, kind)


def round_f64_to(x, dtype):
    """Round float64 -> dtype, round-to-nearest-even, a single rounding (no double rounding through
    float32: float64 -> float32 with round-to-odd, then float32 -> target with RNE, which is exact for
    targets with at most 22 significant bits)."""
    x = np.asarray(x, dtype=np.float64)
    if dtype == np.float64:
        return x.copy()
    if dtype == F32:
        return x.astype(np.float32)
    f = x.astype(np.float32)
    over = np.abs(f.astype(np.float64)) > np.abs(x)
    f = np.where(over, np.nextafter(f, np.float32(0)), f).astype(np.float32)
    inexact = (f.astype(np.float64) != x) & np.isfinite(x)
    bits = f.view(np.uint32) | inexact.astype(np.uint32)
    return bits.view(np.float32).astype(dtype)


def to_dtype_from_f32(x32, dtype):
    """Inputs are generated in float32 and rounded once (RNE) to the activation dtype."""
    return np.asarray(x32, dtype=np.float32).astype(dtype)


def f32(s):
    """A metadata float: parsed as float32, used as float64."""
    return float(np.float32(float(s)))


def f32_str(x):
    return repr(float(np.float32(x)))


# --------------------------------------------------------------------------------------------------
# the oracle (vectorised per sequence, float64)
# --------------------------------------------------------------------------------------------------

ATTN_TYPES = ("decoder", "encoder", "encoder_only", "encoder_decoder")


class Spec:
    """Metadata of one call, parsed and validated."""

    def __init__(self, t, meta):
        self.attn = meta["attn_type"]
        if self.attn not in ATTN_TYPES:
            raise ValueError("attn_type %r not one of %s" % (self.attn, ATTN_TYPES))
        self.H = int(meta["num_heads"])
        self.Hkv = int(meta["num_kv_heads"])
        self.D = int(meta["head_size"])
        self.scale = f32(meta["scale"])
        self.num_prefills = int(meta["num_prefills"])
        # block_size defaults to key_cache's dim 1 (and must equal it); without a cache it is unused
        self.B = int(meta["block_size"]) if "block_size" in meta else (t["key_cache"].shape[1] if "key_cache" in t else 1)
        self.kvd = meta.get("kv_cache_dtype", "auto")
        self.ks = f32(meta.get("k_scale", "1.0"))
        self.vs = f32(meta.get("v_scale", "1.0"))
        self.window = int(meta["sliding_window"]) if "sliding_window" in meta else None
        self.cap = f32(meta["logits_soft_cap"]) if "logits_soft_cap" in meta else None
        if self.cap is not None and not self.cap > 0:
            self.cap = None
        if self.H % self.Hkv:
            raise ValueError("num_heads %d not a multiple of num_kv_heads %d" % (self.H, self.Hkv))
        if self.window is not None and (self.attn != "decoder" or self.window <= 0):
            raise ValueError("sliding_window %d is only supported (> 0) for decoder" % self.window)
        if self.kvd not in ("auto",) + tuple(FP8):
            raise ValueError("kv_cache_dtype %r" % self.kvd)
        q = t["query"]
        if q.ndim != 3 or q.shape[1:] != (self.H, self.D) or q.dtype not in (F32, F16, BF16):
            raise ValueError("query: shape %s dtype %s" % (q.shape, q.dtype))
        self.dtype = q.dtype
        self.T = q.shape[0]
        self.qsl = t["query_start_loc"].astype(np.int64)
        self.seq_lens = t["seq_lens"].astype(np.int64)
        self.S = len(self.seq_lens)
        if len(self.qsl) != self.S + 1 or self.qsl[0] != 0 or self.qsl[-1] != self.T or np.any(np.diff(self.qsl) < 0):
            raise ValueError("query_start_loc %s inconsistent with T=%d, S=%d" % (self.qsl, self.T, self.S))
        self.ns = np.diff(self.qsl)
        if not 0 <= self.num_prefills <= self.S or np.any(self.ns[self.num_prefills:] != 1):
            raise ValueError("decodes (after num_prefills=%d) must have one query each: %s" % (self.num_prefills, self.ns))
        self.has_cache = "key_cache" in t
        self.has_kv = "key" in t
        for n in ("key", "value"):
            if n in t and (t[n].dtype != self.dtype or t[n].shape[1:] != (self.Hkv, self.D)):
                raise ValueError("%s: shape %s dtype %s" % (n, t[n].shape, t[n].dtype))
        if self.has_cache:
            kc = t["key_cache"]
            want = np.dtype(np.uint8) if self.kvd != "auto" else self.dtype
            if kc.dtype != want or kc.ndim != 4 or kc.shape[1:] != (self.B, self.Hkv, self.D) or t["value_cache"].shape != kc.shape \
                    or t["value_cache"].dtype != want:
                raise ValueError("key_cache/value_cache: shape %s dtype %s, want [NB, %d, %d, %d] %s"
                                 % (kc.shape, kc.dtype, self.B, self.Hkv, self.D, want))
            self.NB = kc.shape[0]
        if self.attn in ("encoder", "encoder_only") and self.has_cache:
            raise ValueError("%s attention never uses a cache" % self.attn)
        if self.attn == "encoder_decoder":
            self.enc_lens = t["encoder_seq_lens"].astype(np.int64)
            self.enc_start = np.concatenate([[0], np.cumsum(self.enc_lens)])
            if self.has_kv and len(t["key"]) != self.enc_start[-1]:
                raise ValueError("key has %d tokens, encoder_seq_lens sum to %d" % (len(t["key"]), self.enc_start[-1]))
            if not self.has_kv and not self.has_cache:
                raise ValueError("encoder_decoder needs key/value or a cache")
        elif not self.has_kv:
            raise ValueError("key/value are only absent for encoder_decoder")
        elif len(t["key"]) != self.T:
            raise ValueError("key has %d tokens, query %d" % (len(t["key"]), self.T))


def _slot_mapping(sp, t):
    if not (sp.has_cache and sp.has_kv):
        return None
    sm = t["cross_slot_mapping" if sp.attn == "encoder_decoder" else "slot_mapping"].astype(np.int64)
    if len(sm) != len(t["key"]):
        raise ValueError("slot mapping has %d entries, key %d tokens" % (len(sm), len(t["key"])))
    return sm


def forward(t, meta):
    """Run one call. Returns (float64 output [T, H, D], {output, key_cache, value_cache})."""
    sp = Spec(t, meta)
    H, Hkv, D, B, G = sp.H, sp.Hkv, sp.D, sp.B, sp.H // sp.Hkv
    key, value = t.get("key"), t.get("value")
    sm = _slot_mapping(sp, t)
    res = {}

    # 1. cache write
    if sp.has_cache:
        kc, vc = t["key_cache"].copy(), t["value_cache"].copy()
        kflat, vflat = kc.reshape(sp.NB * B, Hkv, D), vc.reshape(sp.NB * B, Hkv, D)
        if sm is not None:
            w = sm != -1
            slots = sm[w]
            if np.any((slots < 0) | (slots >= sp.NB * B)):
                raise ValueError("slot outside the cache (%d slots): %s" % (sp.NB * B, slots[(slots < 0) | (slots >= sp.NB * B)]))
            if len(np.unique(slots)) != len(slots):
                raise ValueError("a slot is written twice")
            if sp.kvd == "auto":
                kflat[slots] = key[w]
                vflat[slots] = value[w]
            else:
                kflat[slots] = quantize(key[w], sp.ks, sp.kvd)
                vflat[slots] = quantize(value[w], sp.vs, sp.kvd)
        res["key_cache"], res["value_cache"] = kc, vc

        def load(slots):
            slots = np.asarray(slots, dtype=np.int64)
            if np.any((slots < 0) | (slots >= sp.NB * B)):
                raise ValueError("block table points outside the cache")
            if sp.kvd == "auto":
                return kflat[slots].astype(np.float64), vflat[slots].astype(np.float64)
            return (fp8_decode(kflat[slots], sp.kvd) * sp.ks, fp8_decode(vflat[slots], sp.kvd) * sp.vs)

        def keys_of(positions, unwritten, tokens, table):
            """K, V [len(positions), Hkv, D]: a position's key from the cache through `table`,
            or, where `unwritten` (a new token with slot -1: not written, still a key), the
            call's token `tokens[i]` as the cache would hold it."""
            K, V = np.zeros((len(positions), Hkv, D)), np.zeros((len(positions), Hkv, D))
            cached = ~unwritten
            if cached.any():
                p = positions[cached]
                K[cached], V[cached] = load(table[p // B] * B + p % B)
            if unwritten.any():
                tok = tokens[unwritten]
                if sp.kvd == "auto":
                    K[unwritten], V[unwritten] = key[tok].astype(np.float64), value[tok].astype(np.float64)
                else:
                    K[unwritten] = fp8_decode(quantize(key[tok], sp.ks, sp.kvd), sp.kvd) * sp.ks
                    V[unwritten] = fp8_decode(quantize(value[tok], sp.vs, sp.kvd), sp.kvd) * sp.vs
            return K, V

    slopes = t["alibi_slopes"].astype(np.float64) if "alibi_slopes" in t else None
    qf = t["query"].astype(np.float64)
    out = np.zeros((sp.T, H, D))

    for s in range(sp.S):
        q0, q1 = int(sp.qsl[s]), int(sp.qsl[s + 1])
        n = q1 - q0
        if n == 0:
            continue
        # 2. keys of the sequence: positions js, K/V [nk, Hkv, D] in float64, query positions qpos
        if sp.attn == "decoder":
            L = int(sp.seq_lens[s])
            ctx = L - n
            if ctx < 0:
                raise ValueError("seq_lens[%d]=%d < %d new tokens" % (s, L, n))
            qpos = ctx + np.arange(n)
            if sp.has_cache:
                bt = t["block_tables"][s].astype(np.int64)
                if len(bt) * B < L:
                    raise ValueError("block_tables row %d too short for seq_len %d" % (s, L))
                js = np.arange(L, dtype=np.int64)
                tokens = q0 + js - ctx
                unwritten = (js >= ctx) & (sm[np.clip(tokens, q0, max(q0, q1 - 1))] == -1)
                K, V = keys_of(js, unwritten, tokens, bt)
            else:
                if ctx != 0:
                    raise ValueError("decoder without a cache needs seq_lens == new tokens (seq %d)" % s)
                js = np.arange(n)
                K, V = key[q0:q1].astype(np.float64), value[q0:q1].astype(np.float64)
        elif sp.attn in ("encoder", "encoder_only"):
            if sp.seq_lens[s] != n:
                raise ValueError("%s: seq_lens[%d]=%d != %d query tokens" % (sp.attn, s, sp.seq_lens[s], n))
            qpos = np.arange(n)
            js = np.arange(n)
            K, V = key[q0:q1].astype(np.float64), value[q0:q1].astype(np.float64)
        else:  # encoder_decoder
            qpos = int(sp.seq_lens[s]) - n + np.arange(n)
            E, e0 = int(sp.enc_lens[s]), int(sp.enc_start[s])
            if sp.has_cache:
                cbt = t["cross_block_tables"][s].astype(np.int64)
                if len(cbt) * B < E:
                    raise ValueError("cross_block_tables row %d too short for encoder_seq_len %d" % (s, E))
                js = np.arange(E, dtype=np.int64)
                tokens = e0 + js
                unwritten = sm[tokens] == -1 if sm is not None else np.zeros(E, dtype=bool)
                K, V = keys_of(js, unwritten, tokens, cbt)
            else:
                js = np.arange(E)
                K, V = key[e0:e0 + E].astype(np.float64), value[e0:e0 + E].astype(np.float64)
        if len(js) == 0:
            continue  # no key at all: zero output
        Kh, Vh = np.repeat(K, G, axis=1), np.repeat(V, G, axis=1)  # q head h reads kv head h // G
        # 3. scores [H, n, nk]
        sc = sp.scale * np.einsum("mhd,khd->hmk", qf[q0:q1], Kh)
        if sp.cap is not None:
            sc = sp.cap * np.tanh(sc / sp.cap)
        rel = (js[None, :] - qpos[:, None]).astype(np.float64)  # j - i, [n, nk]
        if slopes is not None:
            sc = sc + slopes[:, None, None] * (rel if sp.attn == "decoder" else -np.abs(rel))[None]
        # 4. mask
        allowed = np.ones(rel.shape, dtype=bool)
        if sp.attn == "decoder":
            allowed = rel <= 0
            if sp.window is not None:
                allowed &= rel > -sp.window
        allowed = np.broadcast_to(allowed[None], sc.shape)
        # 5. softmax and weighted sum
        sc = np.where(allowed, sc, -np.inf)
        mx = np.max(sc, axis=2, keepdims=True)
        any_ok = np.isfinite(mx)
        p = np.where(allowed, np.exp(sc - np.where(any_ok, mx, 0.0)), 0.0)
        den = p.sum(axis=2, keepdims=True)
        p = np.where(any_ok, p / np.where(any_ok, den, 1.0), 0.0)
        out[q0:q1] = np.einsum("hmk,khd->mhd", p, Vh)

    res["output"] = round_f64_to(out, sp.dtype)
    return out, res


# --------------------------------------------------------------------------------------------------
# brute force: a second, straightforward implementation (pure Python loops, own fp8 tables)
# --------------------------------------------------------------------------------------------------

def _fp8_code_value(code, kind):
    """Exact value of an fp8 code from its bits (None for NaN, +-inf for e5m2 inf)."""
    sign = -1.0 if code & 0x80 else 1.0
    if kind == "fp8_e4m3":
        e, m = (code >> 3) & 0xF, code & 0x7
        if e == 0xF and m == 0x7:
            return None
        v = m / 8.0 * 2.0 ** -6 if e == 0 else (1 + m / 8.0) * 2.0 ** (e - 7)
    else:
        e, m = (code >> 2) & 0x1F, code & 0x3
        if e == 0x1F:
            return None if m else sign * math.inf
        v = m / 4.0 * 2.0 ** -14 if e == 0 else (1 + m / 4.0) * 2.0 ** (e - 15)
    return sign * v


_POS_CODES = {}


def _positive_finite_codes(kind):
    if kind not in _POS_CODES:
        lst = []
        for c in range(0x80):
            v = _fp8_code_value(c, kind)
            if v is not None and math.isfinite(v):
                lst.append((c, v))
        _POS_CODES[kind] = lst
    return _POS_CODES[kind]


def brute_fp8_encode(x, kind):
    """Nearest finite code by exhaustive search (ties -> even code), sign kept, NaN -> 0x7F."""
    if math.isnan(x):
        return 0x7F
    sign = 0x80 if math.copysign(1.0, x) < 0 else 0
    a = abs(x)
    codes = _positive_finite_codes(kind)
    if a >= codes[-1][1]:  # beyond the largest finite value (inf included): saturate
        return sign | codes[-1][0]
    best = None
    for c, v in codes:
        d = abs(a - v)
        if best is None or d < best[0] or (d == best[0] and c % 2 == 0):
            best = (d, c)
    return sign | best[1]


def brute_forward(t, meta):
    """Same contract, written as plain loops. Returns (float64 output as nested lists, caches)."""
    attn = meta["attn_type"]
    H, Hkv, D = int(meta["num_heads"]), int(meta["num_kv_heads"]), int(meta["head_size"])
    G = H // Hkv
    scale = float(np.float32(meta["scale"]))
    B = int(meta["block_size"])
    kvd = meta["kv_cache_dtype"]
    ks, vs = float(np.float32(meta["k_scale"])), float(np.float32(meta["v_scale"]))
    W = int(meta["sliding_window"]) if "sliding_window" in meta else 0
    cap = float(np.float32(meta["logits_soft_cap"])) if "logits_soft_cap" in meta else 0.0
    q = t["query"].astype(np.float64).tolist()
    T = len(q)
    qsl = [int(v) for v in t["query_start_loc"]]
    seq_lens = [int(v) for v in t["seq_lens"]]
    slopes = [float(v) for v in t["alibi_slopes"]] if "alibi_slopes" in t else None
    key = t["key"] if "key" in t else None
    value = t["value"] if "value" in t else None
    cache = "key_cache" in t
    caches = {}

    def elem(stored, sc):
        if kvd == "auto":
            return float(stored)
        return _fp8_code_value(int(stored), kvd) * sc

    if cache:
        kc, vc = t["key_cache"].copy(), t["value_cache"].copy()
        NB = kc.shape[0]
        smap = None
        if key is not None:
            smap = [int(v) for v in t["cross_slot_mapping" if attn == "encoder_decoder" else "slot_mapping"]]
            for tok, slot in enumerate(smap):
                if slot == -1:
                    continue
                blk, off = slot // B, slot % B
                for c, src, sc in ((kc, key, ks), (vc, value, vs)):
                    for hh in range(Hkv):
                        for d in range(D):
                            x = src[tok, hh, d]
                            if kvd == "auto":
                                c[blk, off, hh, d] = x
                            else:
                                # float32 division done as f64 division rounded once to f32 (exact)
                                qv = float(np.float32(float(np.float32(x)) / sc))
                                c[blk, off, hh, d] = brute_fp8_encode(qv, kvd)
        caches = {"key_cache": kc, "value_cache": vc}

        def read(slot):
            blk, off = slot // B, slot % B
            assert 0 <= blk < NB
            kk = [[elem(kc[blk, off, hh, d], ks) for d in range(D)] for hh in range(Hkv)]
            vv = [[elem(vc[blk, off, hh, d], vs) for d in range(D)] for hh in range(Hkv)]
            return kk, vv

    def from_input(tok):
        return key[tok].astype(np.float64).tolist(), value[tok].astype(np.float64).tolist()

    def as_cached(tok):
        """Token tok of the call's key/value as the cache would hold it (a slot -1 key)."""
        if kvd == "auto":
            return from_input(tok)

        def stored(x, sc):
            return elem(brute_fp8_encode(float(np.float32(float(np.float32(x)) / sc)), kvd), sc)

        kk = [[stored(key[tok, hh, d], ks) for d in range(D)] for hh in range(Hkv)]
        vv = [[stored(value[tok, hh, d], vs) for d in range(D)] for hh in range(Hkv)]
        return kk, vv

    out = [[[0.0] * D for _ in range(H)] for _ in range(T)]
    for s in range(len(seq_lens)):
        n = qsl[s + 1] - qsl[s]
        keys = []  # (j, K[Hkv][D], V[Hkv][D])
        if attn == "decoder":
            ctx = seq_lens[s] - n
            if cache:
                for j in range(seq_lens[s]):
                    if j >= ctx and smap[qsl[s] + (j - ctx)] == -1:
                        keys.append((j,) + as_cached(qsl[s] + (j - ctx)))
                        continue
                    blk = int(t["block_tables"][s][j // B])
                    keys.append((j,) + read(blk * B + j % B))
            else:
                for j in range(n):
                    keys.append((j,) + from_input(qsl[s] + j))
        elif attn in ("encoder", "encoder_only"):
            ctx = 0
            for j in range(n):
                keys.append((j,) + from_input(qsl[s] + j))
        else:
            ctx = seq_lens[s] - n
            E = int(t["encoder_seq_lens"][s])
            e0 = int(sum(int(v) for v in t["encoder_seq_lens"][:s]))
            for j in range(E):
                if cache:
                    if key is not None and smap[e0 + j] == -1:
                        keys.append((j,) + as_cached(e0 + j))
                        continue
                    blk = int(t["cross_block_tables"][s][j // B])
                    keys.append((j,) + read(blk * B + j % B))
                else:
                    keys.append((j,) + from_input(e0 + j))
        for m in range(n):
            tok = qsl[s] + m
            i = ctx + m
            for h in range(H):
                kh = h // G
                scores, vals = [], []
                for j, K, V in keys:
                    if attn == "decoder" and (j > i or (W > 0 and j <= i - W)):
                        continue
                    dot = 0.0
                    for d in range(D):
                        dot += q[tok][h][d] * K[kh][d]
                    x = scale * dot
                    if cap > 0:
                        x = cap * math.tanh(x / cap)
                    if slopes is not None:
                        x += slopes[h] * (j - i) if attn == "decoder" else -slopes[h] * abs(j - i)
                    scores.append(x)
                    vals.append(V[kh])
                if not scores:
                    continue
                mx = max(scores)
                ws = [math.exp(x - mx) for x in scores]
                tot = sum(ws)
                for d in range(D):
                    out[tok][h][d] = sum(w * v[d] for w, v in zip(ws, vals)) / tot
    return out, caches


# --------------------------------------------------------------------------------------------------
# case generation
# --------------------------------------------------------------------------------------------------

def _garbage_float(rng, shape, dtype):
    """Values no sequence covers: big numbers, NaN, +-inf."""
    g = (rng.standard_normal(shape) * 1000.0).astype(np.float32)
    u = rng.random(shape)
    g[u < 0.08] = np.nan
    g[(u >= 0.08) & (u < 0.12)] = np.inf
    g[(u >= 0.12) & (u < 0.16)] = -np.inf
    g[(u >= 0.16) & (u < 0.18)] = -np.nan
    g = g.astype(dtype)
    return g


def _garbage_u8(rng, shape):
    g = rng.integers(0, 256, size=shape, dtype=np.uint8)
    u = rng.random(shape)
    g[u < 0.2] = 0x7F
    g[(u >= 0.2) & (u < 0.4)] = 0xFF
    return g


def _garbage_cache(rng, shape, dtype, kvd):
    return _garbage_u8(rng, shape) if kvd != "auto" else _garbage_float(rng, shape, dtype)


def _store(x, kvd, scale):
    return x.copy() if kvd == "auto" else quantize(x, scale, kvd)


def _values(rng, shape, sign):
    """Value vectors: each (kv head, dim) keeps one sign across tokens, magnitudes in [0.1, 1], so every
    output element is a convex combination of same-sign numbers (|out| >= 0.1): relative tolerances
    are then meaningful for every element."""
    return (sign * rng.uniform(0.1, 1.0, size=shape)).astype(np.float32)


def _assign_blocks(rng, NB, needs):
    """Shuffled physical blocks for sequences needing `needs[s]` blocks; rows padded with 0."""
    assert sum(needs) <= NB, (needs, NB)
    perm = rng.permutation(NB)
    M = max(max(needs), 1)
    bt = np.zeros((len(needs), M), dtype=np.int32)
    k = 0
    for s, nb in enumerate(needs):
        bt[s, :nb] = perm[k:k + nb]
        k += nb
    return bt


def _base_meta(attn, H, Hkv, D, scale, num_prefills, B, kvd="auto", ks=1.0, vs=1.0, window=None, cap=None):
    m = {"attn_type": attn, "num_heads": str(H), "num_kv_heads": str(Hkv), "head_size": str(D),
         "scale": f32_str(scale), "num_prefills": str(num_prefills), "block_size": str(B),
         "kv_cache_dtype": kvd, "k_scale": f32_str(ks), "v_scale": f32_str(vs)}
    if window is not None:
        m["sliding_window"] = str(int(window))
    if cap is not None:
        m["logits_soft_cap"] = f32_str(cap)
    return m


def bloom_slopes(H):
    return np.array([2.0 ** (-8.0 * (h + 1) / H) for h in range(H)], dtype=np.float32)


def make_decoder(seed, dtype, H, Hkv, D, B, NB, seqs, num_prefills, kvd="auto", ks=1.0, vs=1.0, alibi=False,
                 window=None, cap=None, scale=None, neg=(), cache=True, fp8_extremes=False, qscale=1.0):
    """seqs: [(ctx, n)] prefills first. neg: global token indices whose slot is -1."""
    rng = np.random.default_rng(seed)
    S = len(seqs)
    ns = [n for _, n in seqs]
    Ls = [c + n for c, n in seqs]
    T = sum(ns)
    qsl = np.concatenate([[0], np.cumsum(ns)]).astype(np.int32)
    sign = rng.choice([-1.0, 1.0], size=(Hkv, D)).astype(np.float32)
    K32 = [rng.standard_normal((L, Hkv, D)).astype(np.float32) for L in Ls]
    V32 = [_values(rng, (L, Hkv, D), sign) for L in Ls]
    Q32 = (rng.standard_normal((T, H, D)) * qscale).astype(np.float32)
    if fp8_extremes:
        big = 300.0 if kvd == "fp8_e4m3" else 30000.0
        Q32[..., 0] = 0.0  # dim 0 carries saturating keys; q ignores it so scores stay sane
        for s in range(S):
            L = Ls[s]
            K32[s][:, :, 0] = rng.choice([-1.0, 1.0], size=(L, Hkv)) * rng.uniform(big, 2 * big, size=(L, Hkv))
            K32[s][::5, 0, 1] = -0.0
            K32[s][1::7, :, 2:6] *= 1e-3 if kvd == "fp8_e4m3" else 3e-5  # fp8 subnormal range
            if kvd == "fp8_e4m3":  # values past 448 * v_scale saturate
                V32[s][::3, :, 1] = sign[:, 1] * rng.uniform(1000.0, 3000.0, size=(len(range(0, L, 3)), Hkv))
        # infinities in the new tokens' keys (dim 0): they saturate too
        last = S - 1
        K32[0][seqs[0][0], 0, 0] = np.inf
        K32[last][seqs[last][0], Hkv - 1, 0] = -np.inf
    Kd = [to_dtype_from_f32(k, dtype) for k in K32]
    Vd = [to_dtype_from_f32(v, dtype) for v in V32]
    q = to_dtype_from_f32(Q32, dtype)
    key = np.concatenate([Kd[s][c:] for s, (c, _) in enumerate(seqs)])
    value = np.concatenate([Vd[s][c:] for s, (c, _) in enumerate(seqs)])
    t = {"query": q, "key": key, "value": value, "query_start_loc": qsl,
         "seq_lens": np.array(Ls, dtype=np.int32)}
    if cache:
        bt = _assign_blocks(rng, NB, [-(-L // B) for L in Ls])
        cdt = dtype if kvd == "auto" else np.dtype(np.uint8)
        kc = _garbage_cache(rng, (NB, B, Hkv, D), cdt, kvd)
        vc = _garbage_cache(rng, (NB, B, Hkv, D), cdt, kvd)
        sm = np.zeros(T, dtype=np.int64)
        for s, (c, n) in enumerate(seqs):
            for j in range(Ls[s]):
                slot = int(bt[s, j // B]) * B + j % B
                if j < c:  # context written by an earlier call
                    kc[slot // B, slot % B] = _store(Kd[s][j], kvd, ks)
                    vc[slot // B, slot % B] = _store(Vd[s][j], kvd, vs)
                else:
                    tok = int(qsl[s]) + j - c
                    sm[tok] = -1 if tok in neg else slot
        t.update(key_cache=kc, value_cache=vc, slot_mapping=sm, block_tables=bt)
    else:
        assert all(c == 0 for c, _ in seqs) and not neg
    if alibi:
        t["alibi_slopes"] = bloom_slopes(H)
    meta = _base_meta("decoder", H, Hkv, D, scale if scale is not None else D ** -0.5, num_prefills, B, kvd, ks, vs,
                      window, cap)
    return t, meta


def make_encoder(seed, attn, dtype, H, Hkv, D, ns, alibi=False):
    rng = np.random.default_rng(seed)
    T = sum(ns)
    sign = rng.choice([-1.0, 1.0], size=(Hkv, D)).astype(np.float32)
    t = {"query": to_dtype_from_f32(rng.standard_normal((T, H, D)), dtype),
         "key": to_dtype_from_f32(rng.standard_normal((T, Hkv, D)), dtype),
         "value": to_dtype_from_f32(_values(rng, (T, Hkv, D), sign), dtype),
         "query_start_loc": np.concatenate([[0], np.cumsum(ns)]).astype(np.int32),
         "seq_lens": np.array(ns, dtype=np.int32)}
    if alibi:
        t["alibi_slopes"] = bloom_slopes(H)
    return t, _base_meta(attn, H, Hkv, D, D ** -0.5, len(ns), 16)


def make_encdec(seed, dtype, H, Hkv, D, B, NB, dec_lens, ns, enc_lens, with_kv, cache, neg_cross=(), alibi=False):
    """Cross-attention call. dec_lens: decoder seq_lens; ns: new decoder tokens per sequence.
    with_kv: key/value of the encoder tokens are inputs (prefill); otherwise the cross cache is pre-filled."""
    rng = np.random.default_rng(seed)
    S = len(ns)
    T, Tk = sum(ns), sum(enc_lens)
    sign = rng.choice([-1.0, 1.0], size=(Hkv, D)).astype(np.float32)
    q = to_dtype_from_f32(rng.standard_normal((T, H, D)), dtype)
    k = to_dtype_from_f32(rng.standard_normal((Tk, Hkv, D)), dtype)
    v = to_dtype_from_f32(_values(rng, (Tk, Hkv, D), sign), dtype)
    num_prefills = S if with_kv else 0
    if not with_kv:
        assert all(n == 1 for n in ns) and not neg_cross
    t = {"query": q, "query_start_loc": np.concatenate([[0], np.cumsum(ns)]).astype(np.int32),
         "seq_lens": np.array(dec_lens, dtype=np.int32), "encoder_seq_lens": np.array(enc_lens, dtype=np.int32)}
    if with_kv:
        t["key"], t["value"] = k, v
    if cache:
        cbt = _assign_blocks(rng, NB, [-(-E // B) for E in enc_lens])
        kc = _garbage_float(rng, (NB, B, Hkv, D), dtype)
        vc = _garbage_float(rng, (NB, B, Hkv, D), dtype)
        csm = np.zeros(Tk, dtype=np.int64)
        e0 = 0
        for s, E in enumerate(enc_lens):
            for j in range(E):
                slot = int(cbt[s, j // B]) * B + j % B
                if with_kv:
                    csm[e0 + j] = -1 if (e0 + j) in neg_cross else slot
                else:  # written by the prefill call
                    kc[slot // B, slot % B] = k[e0 + j]
                    vc[slot // B, slot % B] = v[e0 + j]
            e0 += E
        t.update(key_cache=kc, value_cache=vc, cross_block_tables=cbt)
        if with_kv:
            t["cross_slot_mapping"] = csm
    if alibi:
        t["alibi_slopes"] = bloom_slopes(H)
    return t, _base_meta("encoder_decoder", H, Hkv, D, D ** -0.5, num_prefills, B)


# Mixed batch: 2 prompt chunks on top of cached context, 1 fresh prompt, 3 decodes.
MIXED = [(20, 12), (33, 9), (0, 14), (16, 1), (39, 1), (4, 1)]

CASES = {
    # name: (builder, kwargs, description)
    "decoder_mixed_f32": (make_decoder, dict(dtype=F32, H=8, Hkv=2, D=32, B=16, NB=14, seqs=MIXED, num_prefills=3),
                          "decoder, f32, GQA 8/2, D=32, B=16: 2 chunked prefills over cached context + fresh prompt + 3 decodes"),
    "decoder_mixed_f16": (make_decoder, dict(dtype=F16, H=8, Hkv=2, D=64, B=16, NB=14, seqs=MIXED, num_prefills=3),
                          "as decoder_mixed_f32 in f16, D=64"),
    "decoder_mixed_bf16": (make_decoder, dict(dtype=BF16, H=8, Hkv=2, D=64, B=16, NB=14, seqs=MIXED, num_prefills=3),
                           "as decoder_mixed_f32 in bf16, D=64"),
    "decoder_alibi": (make_decoder, dict(dtype=F32, H=8, Hkv=2, D=32, B=16, NB=14, seqs=MIXED, num_prefills=3, alibi=True),
                      "mixed batch with Bloom ALiBi slopes 2^-(h+1), f32"),
    "decoder_window": (make_decoder, dict(dtype=BF16, H=8, Hkv=2, D=32, B=16, NB=8, seqs=[(10, 8), (0, 9), (11, 1), (2, 1)],
                                          num_prefills=2, window=5, neg=(12,)),
                       "sliding_window=5, bf16, chunk over context + prompt with one slot -1 token (t=12) + 2 decodes"),
    "decoder_softcap": (make_decoder, dict(dtype=F16, H=4, Hkv=2, D=32, B=16, NB=8, seqs=[(7, 10), (0, 12), (25, 1)],
                                           num_prefills=2, cap=30.0, scale=2.0),
                        "logits_soft_cap=30 with scale 2.0 (raw scores up to ~+-60), f16"),
    "decoder_mqa": (make_decoder, dict(dtype=F16, H=8, Hkv=1, D=128, B=16, NB=6, seqs=[(5, 6), (0, 7), (30, 1), (9, 1)],
                                       num_prefills=2),
                    "MQA (8 query heads, 1 kv head), D=128, f16"),
    "decoder_block1": (make_decoder, dict(dtype=F32, H=4, Hkv=2, D=16, B=1, NB=96, seqs=[(6, 9), (0, 11), (23, 1), (30, 1)],
                                          num_prefills=2),
                       "block_size 1 (block table = slot list), D=16, f32"),
    "decoder_block3": (make_decoder, dict(dtype=BF16, H=4, Hkv=2, D=32, B=3, NB=30, seqs=[(7, 8), (0, 10), (19, 1), (2, 1)],
                                          num_prefills=2),
                       "block_size 3 (positions straddle blocks at odd offsets), D=32, bf16"),
    "decoder_fp8_e4m3": (make_decoder, dict(dtype=BF16, H=8, Hkv=2, D=32, B=16, NB=10, seqs=[(12, 9), (0, 10), (21, 1), (3, 1)],
                                            num_prefills=2, kvd="fp8_e4m3", ks=0.5, vs=2.0, fp8_extremes=True),
                         "fp8 e4m3 cache, k_scale 0.5, v_scale 2.0, bf16; saturating keys (+-inf too) and values, -0.0, subnormals"),
    "decoder_fp8_e5m2": (make_decoder, dict(dtype=F16, H=8, Hkv=2, D=32, B=16, NB=10, seqs=[(12, 9), (0, 10), (21, 1), (3, 1)],
                                            num_prefills=2, kvd="fp8_e5m2", ks=0.5, vs=2.0, fp8_extremes=True),
                         "fp8 e5m2 cache, k_scale 0.5, v_scale 2.0, f16; saturating keys (+-inf too), -0.0, subnormals"),
    "decoder_nocache": (make_decoder, dict(dtype=F32, H=4, Hkv=2, D=64, B=16, NB=0, seqs=[(0, 7), (0, 12), (0, 5)],
                                           num_prefills=3, cache=False),
                        "decoder without a cache (causal over the input key/value), 3 fresh prompts, f32"),
    "encoder_only_f32": (make_encoder, dict(attn="encoder_only", dtype=F32, H=8, Hkv=2, D=32, ns=[9, 0, 14, 1], alibi=True),
                         "encoder_only, f32, GQA, ALiBi (-slope*|j-i|), lengths 9, 0, 14, 1"),
    "encoder_only_bf16": (make_encoder, dict(attn="encoder_only", dtype=BF16, H=4, Hkv=4, D=64, ns=[0, 11, 6]),
                          "encoder_only, bf16, MHA, lengths 0, 11, 6"),
    "encoder_f16": (make_encoder, dict(attn="encoder", dtype=F16, H=4, Hkv=2, D=128, ns=[10, 7]),
                    "encoder (enc-dec encoder self-attention), f16, D=128"),
    "encoder_decoder_prefill": (make_encdec, dict(dtype=F16, H=4, Hkv=2, D=64, B=8, NB=8, dec_lens=[5, 4, 6], ns=[5, 4, 6],
                                                  enc_lens=[13, 0, 19], with_kv=True, cache=True, neg_cross=(20,)),
                                "cross-attention prefill, f16, B=8: key/value written via cross_slot_mapping (one -1), an empty encoder sequence"),
    "encoder_decoder_decode": (make_encdec, dict(dtype=BF16, H=4, Hkv=2, D=64, B=8, NB=10, dec_lens=[9, 1, 15, 30],
                                                 ns=[1, 1, 1, 1], enc_lens=[13, 6, 21, 1], with_kv=False, cache=True),
                               "cross-attention decode, bf16: no key/value, cross cache pre-filled, num_prefills=0"),
    "encoder_decoder_alibi": (make_encdec, dict(dtype=F32, H=8, Hkv=2, D=16, B=4, NB=14, dec_lens=[3, 12, 20],
                                                ns=[1, 1, 1], enc_lens=[9, 17, 5], with_kv=False, cache=True, alibi=True),
                              "cross-attention decode with ALiBi (query position seq_len-1 vs encoder position), f32, B=4"),
    "encoder_decoder_nocache": (make_encdec, dict(dtype=F32, H=4, Hkv=4, D=32, B=16, NB=0, dec_lens=[4, 6], ns=[4, 6],
                                                  enc_lens=[8, 11], with_kv=True, cache=False),
                                "cross-attention without a cache (keys are the input key/value tokens), f32"),
}


def build_case(name):
    fn, kw, _ = CASES[name]
    return fn(seed=zlib.crc32(name.encode()), **kw)


def generate(outdir):
    os.makedirs(outdir, exist_ok=True)
    total = 0
    for name in CASES:
        t, meta = build_case(name)
        cpath = os.path.join(outdir, name + ".case.safetensors")
        epath = os.path.join(outdir, name + ".expected.safetensors")
        write_safetensors(cpath, t, meta)
        t2, meta2 = read_safetensors(cpath)  # the oracle runs on what was written
        _, res = forward(t2, meta2)
        write_safetensors(epath, res)
        sz = os.path.getsize(cpath) + os.path.getsize(epath)
        total += sz
        print("%-26s %7d bytes  %s" % (name, sz, CASES[name][2]))
    print("total %d bytes" % total)


# --------------------------------------------------------------------------------------------------
# --check
# --------------------------------------------------------------------------------------------------

TOL = {F32: 1e-4, F16: 5e-3, BF16: 2e-2}


def check(out_path, exp_path):
    try:
        got, _ = read_safetensors(out_path)
        exp, _ = read_safetensors(exp_path)
    except (OSError, ValueError, KeyError) as e:
        print("error: %s" % e)
        return 1
    ok = True
    if "output" not in got:
        print("FAIL: %s has no tensor 'output'" % out_path)
        return 1
    a, b = got["output"], exp["output"]
    if a.dtype != b.dtype or a.shape != b.shape:
        print("FAIL: output is %s %s, expected %s %s" % (a.dtype, list(a.shape), b.dtype, list(b.shape)))
        return 1
    tol = TOL[b.dtype]
    a64, b64 = a.astype(np.float64), b.astype(np.float64)
    err = np.abs(a64 - b64)
    bound = tol * (np.abs(b64) + 1e-6)
    bad = ~(err <= bound)  # NaN counts as bad
    with np.errstate(invalid="ignore", divide="ignore"):
        rel = err / (np.abs(b64) + 1e-6)
    max_abs = float(np.max(err)) if err.size else 0.0  # NaN shows as nan
    max_rel = float(np.max(rel)) if rel.size else 0.0
    nnan = int(np.isnan(a64).sum())
    print("output %s %s: max abs err %.3e, max rel err %.3e (tol %g), %d/%d elements out of tolerance%s"
          % (b.dtype, list(b.shape), max_abs, max_rel, tol, int(bad.sum()), b.size,
             ", %d NaN" % nnan if nnan else ""))
    if bad.any():
        ok = False
        idx = tuple(int(i) for i in np.argwhere(bad)[0])
        print("FAIL: first bad element %s: got %r expected %r" % (list(idx), float(a64[idx]), float(b64[idx])))
    for name in ("key_cache", "value_cache"):
        if name not in exp:
            continue
        if name not in got:
            print("FAIL: %s missing" % name)
            ok = False
            continue
        x, y = got[name], exp[name]
        if x.dtype != y.dtype or x.shape != y.shape:
            print("FAIL: %s is %s %s, expected %s %s" % (name, x.dtype, list(x.shape), y.dtype, list(y.shape)))
            ok = False
            continue
        xb = np.frombuffer(_le_bytes(x), np.uint8)
        yb = np.frombuffer(_le_bytes(y), np.uint8)
        nd = int((xb != yb).sum())
        if nd:
            ok = False
            elems = np.argwhere(x.reshape(-1).view("u%d" % x.dtype.itemsize) != y.reshape(-1).view("u%d" % y.dtype.itemsize))
            first = np.unravel_index(int(elems[0][0]), x.shape)
            print("FAIL: %s differs in %d bytes (%d elements); first at %s: got %r expected %r"
                  % (name, nd, len(elems), [int(i) for i in first], x[first], y[first]))
        else:
            print("%s %s %s: byte-identical" % (name, y.dtype, list(y.shape)))
    print("PASS" if ok else "FAIL")
    return 0 if ok else 1


# --------------------------------------------------------------------------------------------------
# --selftest
# --------------------------------------------------------------------------------------------------

def _selftest_fp8(rng):
    for kind in FP8:
        dt, fmax = FP8[kind]
        # decode: ml_dtypes against the bit formula, all 256 codes
        for c in range(256):
            a = fp8_decode(np.array([c], np.uint8), kind)[0]
            b = _fp8_code_value(c, kind)
            assert (b is None and np.isnan(a)) or a == b or (math.isnan(a) and b is None), (kind, c, a, b)
        vals = [v for _, v in _positive_finite_codes(kind)]
        assert vals[-1] == fmax
        xs = []
        xs += list(rng.standard_normal(3000) * 10.0 ** rng.uniform(-9, 5.5, 3000))
        mids = [(vals[i] + vals[i + 1]) / 2 for i in range(len(vals) - 1)]
        xs += mids + [-m for m in mids]  # exact ties
        xs += [float(np.nextafter(np.float32(m), np.float32(np.inf))) for m in mids[::3]]
        xs += [float(np.nextafter(np.float32(m), np.float32(-np.inf))) for m in mids[::3]]
        xs += vals + [-v for v in vals]
        xs += [fmax * 1.03, -fmax * 1.2, 1e30, -1e30, math.inf, -math.inf, 0.0, -0.0, math.nan, -math.nan,
               1e-30, -1e-30, vals[1] / 2, -vals[1] / 2, vals[1] * 0.5000001, 3 * vals[1] / 2]
        xs += list((rng.integers(-500, 500, 800) / 16.0) * 2.0 ** rng.integers(-12, 4, 800))  # often ties
        x32 = np.array(xs, dtype=np.float32)
        got = fp8_encode(x32, kind)
        for x, g in zip(x32.tolist(), got.tolist()):
            want = brute_fp8_encode(float(x), kind)
            assert g == want, (kind, x, hex(g), hex(want))
        assert fp8_encode(np.array([-0.0], np.float32), kind)[0] == 0x80
        assert fp8_encode(np.array([np.nan], np.float32), kind)[0] == 0x7F
        print("fp8 %s: encode matches exhaustive search on %d values (incl. %d exact ties); decode on 256 codes"
              % (kind, len(xs), 2 * len(mids)))


def _selftest_rounding(rng):
    for dt in (F16, BF16):
        bits_t = np.uint16
        # candidates: random, exact midpoints between neighbours, and midpoints +- one f64 ulp
        base = (rng.standard_normal(4000) * 10.0 ** rng.uniform(-6, 4, 4000)).astype(dt)
        b = base.view(bits_t)
        nxt = (b + 1).view(dt)  # the neighbour away from zero (same sign)
        mids = (base.astype(np.float64) + nxt.astype(np.float64)) / 2
        ok = np.isfinite(nxt.astype(np.float64))
        mids = mids[ok]
        xs = np.concatenate([rng.standard_normal(4000) * 10.0 ** rng.uniform(-6, 4, 4000), mids,
                             np.nextafter(mids, np.inf), np.nextafter(mids, -np.inf)])
        got = round_f64_to(xs, dt)
        for x, g in zip(xs.tolist(), got.tolist()):
            gv = float(g)
            gb = int(np.array([g], dt).view(bits_t)[0])
            for nb in (gb - 1, gb + 1):
                if (nb ^ gb) & 0x8000 or nb < 0:
                    continue
                nv = float(np.array([nb], bits_t).view(dt)[0])
                if not math.isfinite(nv):
                    continue
                d0, d1 = abs(x - gv), abs(x - nv)
                assert d0 < d1 or (d0 == d1 and gb % 2 == 0), (dt, x, gv, nv)
        # the naive float64 -> float32 -> target path double-rounds some of these
        naive = xs.astype(np.float32).astype(dt)
        print("round f64->%s: %d values checked against neighbours (naive double rounding differs on %d)"
              % (dt, len(xs), int((naive.view(bits_t) != got.view(bits_t)).sum())))


def _tiny_cases():
    yield "tiny decoder fp8+window+alibi+cap+neg", make_decoder(
        seed=1, dtype=BF16, H=4, Hkv=2, D=8, B=2, NB=20, seqs=[(3, 4), (0, 5), (6, 1)], num_prefills=2,
        kvd="fp8_e4m3", ks=0.75, vs=1.5, alibi=True, window=3, cap=5.0, scale=1.3, neg=(1, 5))
    yield "tiny decoder e5m2 extremes", make_decoder(
        seed=2, dtype=F16, H=2, Hkv=1, D=8, B=4, NB=8, seqs=[(2, 3), (5, 1)], num_prefills=1,
        kvd="fp8_e5m2", ks=0.5, vs=2.0, fp8_extremes=True)
    yield "tiny decoder window=1, query w/o keys", make_decoder(
        seed=3, dtype=F32, H=2, Hkv=2, D=4, B=2, NB=6, seqs=[(0, 3), (2, 1)], num_prefills=1, window=1, neg=(0,))
    yield "tiny encoder_only", make_encoder(seed=4, attn="encoder_only", dtype=F16, H=2, Hkv=1, D=8, ns=[3, 0, 4], alibi=True)
    yield "tiny enc-dec prefill", make_encdec(seed=5, dtype=BF16, H=2, Hkv=1, D=8, B=2, NB=8, dec_lens=[2, 3], ns=[2, 3],
                                              enc_lens=[3, 4], with_kv=True, cache=True, neg_cross=(4,), alibi=True)
    yield "tiny enc-dec nocache", make_encdec(seed=6, dtype=F32, H=2, Hkv=2, D=4, B=2, NB=0, dec_lens=[5], ns=[2],
                                              enc_lens=[3], with_kv=True, cache=False, alibi=True)


def _compare_impls(label, t, meta, tmpdir):
    p = os.path.join(tmpdir, "selftest.safetensors")
    write_safetensors(p, t, meta)
    t2, meta2 = read_safetensors(p)
    assert meta2 == meta and set(t2) == set(t)
    for k in t:
        assert t2[k].dtype == t[k].dtype and t2[k].shape == t[k].shape and _le_bytes(t2[k]) == _le_bytes(t[k]), k
    out64, res = forward(t2, meta2)
    bout, bcaches = brute_forward(t2, meta2)
    bout = np.array(bout, dtype=np.float64).reshape(out64.shape)
    err = np.max(np.abs(out64 - bout) / (np.abs(bout) + 1e-12)) if out64.size else 0.0
    assert err < 1e-9, (label, err)
    for name, c in bcaches.items():
        assert _le_bytes(c) == _le_bytes(res[name]), (label, name)
    zero_rows = int(np.sum(np.all(out64 == 0, axis=(1, 2))))
    print("  %-40s brute-force agrees (max rel diff %.1e; %d query tokens with no key)" % (label, err, zero_rows))
    return res


def selftest(full=True):
    import tempfile
    rng = np.random.default_rng(12345)
    _selftest_fp8(rng)
    _selftest_rounding(rng)
    with tempfile.TemporaryDirectory() as d:
        print("oracle vs brute force:")
        for label, (t, meta) in _tiny_cases():
            _compare_impls(label, t, meta, d)
        if full:
            for name in CASES:
                t, meta = build_case(name)
                res = _compare_impls(name, t, meta, d)
                # uncovered slots are garbage with NaN/inf and come through unchanged
                if "key_cache" in t:
                    kc = t["key_cache"]
                    if kc.dtype == np.uint8:
                        assert np.any(kc == 0x7F) and np.any(kc == 0xFF)
                    else:
                        assert np.isnan(kc.astype(np.float32)).any() and np.isinf(kc.astype(np.float32)).any()
                    # garbage never reaches the output: new garbage, same output
                    t3 = dict(t)
                    g = np.random.default_rng(99)
                    for cn in ("key_cache", "value_cache"):
                        c = t[cn].copy()
                        flat = c.reshape(-1, *c.shape[2:])
                        keep = _covered_slots(t, meta)
                        fresh = _garbage_cache(g, flat.shape, c.dtype, meta["kv_cache_dtype"])
                        mask = np.ones(len(flat), bool)
                        mask[list(keep)] = False
                        flat[mask] = fresh[mask]
                        t3[cn] = c
                    _, res3 = forward(t3, meta)
                    assert _le_bytes(res3["output"]) == _le_bytes(res["output"]), name
            # the same prompt, chunked differently, gives the same answer (keys read from the cache)
            _selftest_chunking()
    print("selftest OK")


def _covered_slots(t, meta):
    """Slots that hold real (written or pre-filled) data; a slot -1 token's block-table slot is not one."""
    B = int(meta["block_size"])
    out = set()
    qsl, sl = t["query_start_loc"], t["seq_lens"]
    if meta["attn_type"] == "decoder":
        sm = t["slot_mapping"]
        for s in range(len(sl)):
            ctx = int(sl[s]) - int(qsl[s + 1] - qsl[s])
            for j in range(int(sl[s])):
                if j >= ctx and sm[int(qsl[s]) + j - ctx] == -1:
                    continue
                out.add(int(t["block_tables"][s][j // B]) * B + j % B)
    else:
        sm = t.get("cross_slot_mapping")
        e0 = 0
        for s, E in enumerate(t["encoder_seq_lens"]):
            for j in range(int(E)):
                if sm is None or sm[e0 + j] != -1:
                    out.add(int(t["cross_block_tables"][s][j // B]) * B + j % B)
            e0 += int(E)
    return out


def _selftest_chunking():
    """A 12-token prompt in one call vs chunks 5 + 7 (the second over the cache the first wrote)."""
    t, meta = make_decoder(seed=7, dtype=BF16, H=4, Hkv=2, D=16, B=4, NB=6, seqs=[(0, 12)], num_prefills=1,
                           kvd="fp8_e4m3", ks=0.5, vs=2.0, alibi=True, window=6)
    _, full = forward(t, meta)
    a = {k: v for k, v in t.items()}
    a.update(query=t["query"][:5], key=t["key"][:5], value=t["value"][:5], slot_mapping=t["slot_mapping"][:5],
             query_start_loc=np.array([0, 5], np.int32), seq_lens=np.array([5], np.int32))
    _, r1 = forward(a, meta)
    b = dict(t)
    b.update(query=t["query"][5:], key=t["key"][5:], value=t["value"][5:], slot_mapping=t["slot_mapping"][5:],
             query_start_loc=np.array([0, 7], np.int32), seq_lens=np.array([12], np.int32),
             key_cache=r1["key_cache"], value_cache=r1["value_cache"])
    _, r2 = forward(b, meta)
    joined = np.concatenate([r1["output"], r2["output"]])
    assert _le_bytes(joined) == _le_bytes(full["output"])
    assert _le_bytes(r2["key_cache"]) == _le_bytes(full["key_cache"])
    print("  chunked prefill 5+7 == one call of 12 (output and cache)")


# --------------------------------------------------------------------------------------------------

def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    g = ap.add_mutually_exclusive_group(required=True)
    g.add_argument("--out", metavar="DIR", help="generate all cases into DIR")
    g.add_argument("--check", nargs=2, metavar=("OUT_FILE", "EXPECTED_FILE"), help="compare an output with an expected file")
    g.add_argument("--forward", nargs=2, metavar=("CASE_FILE", "OUT_FILE"), help="run the NumPy oracle on a replay file")
    g.add_argument("--selftest", action="store_true", help="check the oracle against a brute-force implementation")
    ap.add_argument("--quick", action="store_true", help="with --selftest: tiny cases only")
    args = ap.parse_args(argv)
    if args.out:
        generate(args.out)
        return 0
    if args.check:
        return check(*args.check)
    if args.forward:
        try:
            t, meta = read_safetensors(args.forward[0])
            _, res = forward(t, meta)
        except (OSError, ValueError, KeyError) as e:
            print("error: %s" % (e if not isinstance(e, KeyError) else "%s: missing %s" % (args.forward[0], e)))
            return 2
        write_safetensors(args.forward[1], res)
        return 0
    selftest(full=not args.quick)
    return 0


if __name__ == "__main__":
    sys.exit(main())
