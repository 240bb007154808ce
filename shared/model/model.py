"""A compact Qwen2/Qwen3/Llama-compatible causal LM (RMSNorm, RoPE and its scaled variants, GQA, SwiGLU, Qwen3's
per-head q/k norm); its HF-format I/O is checkpoint.py.

The trainer's full-sequence forward and the rollout engine's KV-cache decode run the same modules;
every block linear goes through `precision.py`. On the exact backend, no-grad passes run every op on the log-prob
path through `exact.py`, so decode and the full forward agree to the bit.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from jetroll.shared.model import decode_attention, exact
from jetroll.shared.model.args import ModelArgs
from jetroll.shared.model.precision import (
    InferenceWeights,
    PrecisionLinear,
    is_inference,
    use_exact,
)
from jetroll.shared.model.rope import inv_freq_and_scale
from jetroll.shared.numerics import Numerics

Rope = tuple[torch.Tensor, torch.Tensor]  # cos and signed sin, each [B, S, 1, D]


class KVCache:
    """Preallocated per-slot caches: k[layer] and v[layer] are [num_slots, kv_heads, max_len, head_dim].

    `attention_kernel`: decode reads the cache through `decode_attention`'s CPU kernel where it supports the shape
    (a compiled engine sets it), else through two batched matmuls."""

    def __init__(self, args: ModelArgs, num_slots: int, max_len: int, device: torch.device | str = "cpu",
                 attention_kernel: bool = False) -> None:
        shape = (num_slots, args.num_kv_heads, max_len, args.head_dim)
        self.k = [torch.zeros(shape, device=device) for _ in range(args.num_layers)]
        self.v = [torch.zeros(shape, device=device) for _ in range(args.num_layers)]
        self.max_len = max_len
        self.attention_kernel = attention_kernel

    def copy_slot(self, src: int, dst: int, length: int) -> None:
        for k, v in zip(self.k, self.v, strict=True):
            k[dst, :, :length] = k[src, :, :length]
            v[dst, :, :length] = v[src, :, :length]

    def swap_slots(self, a: int, b: int, length: int) -> None:
        for k, v in zip(self.k, self.v, strict=True):
            k[[a, b], :, :length] = k[[b, a], :, :length]
            v[[a, b], :, :length] = v[[b, a], :, :length]


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float, precision: Numerics) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps
        self.precision = precision

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if use_exact(self.precision):
            return exact.rms_norm(x, self.weight, self.eps)
        return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps))


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """x * cos + rotate_half(x) * sin, with rotate_half's negation folded into `signed_sin` (exact)."""
    return x * cos + x.roll(x.shape[-1] // 2, dims=-1) * signed_sin


class Attention(nn.Module):
    def __init__(self, args: ModelArgs, precision: Numerics) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = args.num_heads, args.num_kv_heads, args.head_dim
        q_dim, kv_dim = args.num_heads * args.head_dim, args.num_kv_heads * args.head_dim
        self.q_proj = PrecisionLinear(args.hidden_size, q_dim, args.attention_bias, precision, "q_proj")
        self.k_proj = PrecisionLinear(args.hidden_size, kv_dim, args.attention_bias, precision, "k_proj")
        self.v_proj = PrecisionLinear(args.hidden_size, kv_dim, args.attention_bias, precision, "v_proj")
        self.o_proj = PrecisionLinear(q_dim, args.hidden_size, False, precision, "o_proj")
        self.qkv = InferenceWeights(self.q_proj, self.k_proj, self.v_proj)
        if args.qk_norm:
            self.q_norm = RMSNorm(args.head_dim, args.rms_norm_eps, precision)
            self.k_norm = RMSNorm(args.head_dim, args.rms_norm_eps, precision)
        self.qk_norm = args.qk_norm
        self.precision = precision
        self.scale = args.head_dim**-0.5

    def _qkv(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """([B, S, H + KV, D] for q and k, [B, S, KV, D] for v)."""
        bsz, seq, _ = x.shape
        if is_inference(self.q_proj):
            qkv = self.qkv.linear(x)
            qkv = qkv.view(bsz, seq, self.num_heads + 2 * self.num_kv_heads, self.head_dim)
            return qkv[:, :, : self.num_heads + self.num_kv_heads], qkv[:, :, self.num_heads + self.num_kv_heads :]
        q = self.q_proj(x).view(bsz, seq, self.num_heads, self.head_dim)
        k = self.k_proj(x).view(bsz, seq, self.num_kv_heads, self.head_dim)
        v = self.v_proj(x).view(bsz, seq, self.num_kv_heads, self.head_dim)
        return torch.cat((q, k), dim=2), v

    def forward(self, x: torch.Tensor, rope: Rope, cache: LayerView | None,
                attn_mask: torch.Tensor | None = None) -> torch.Tensor:
        bsz, seq, _ = x.shape
        qk, v = self._qkv(x)
        if self.qk_norm:
            qk = torch.cat((self.q_norm(qk[:, :, : self.num_heads]), self.k_norm(qk[:, :, self.num_heads :])), dim=2)
        qk = apply_rope(qk, *rope)
        q, k = qk[:, :, : self.num_heads], qk[:, :, self.num_heads :]
        if use_exact(self.precision):
            if attn_mask is not None:
                raise ValueError("the exact backend runs causal attention only; pass no attn_mask")
            return self.o_proj(self._exact(q, k, v, cache))
        if cache is not None and cache.slot is None:  # decode: one query per sequence
            k, v, blocked = cache.update(k, v)
            # GQA without repeat: the G query heads sharing a kv head become G query rows of that head
            q = q.reshape(bsz, self.num_kv_heads, self.num_heads // self.num_kv_heads, self.head_dim)
            if cache.attention_kernel and decode_attention.supports(q, k):
                assert cache.positions is not None
                out = decode_attention.decode_attention(q, cache.k_cache, cache.v_cache, cache.positions + 1,
                                                        self.scale)
                return self.o_proj(out.reshape(bsz, 1, -1))
            # two batched matmuls beat CPU SDPA's flash kernel about 1.7x for a single query row
            scores = torch.matmul(q * self.scale, k.transpose(-1, -2))  # [B, KV, G, L]
            if blocked is not None:
                scores = scores.masked_fill(blocked, float("-inf"))
            out = torch.matmul(torch.softmax(scores, dim=-1), v)  # [B, KV, G, D]
            return self.o_proj(out.reshape(bsz, 1, -1))
        if cache is not None and cache.start:  # append to a running sequence: attend over its cache too
            k, v, _ = cache.update(k, v)  # [1, KV, L, D]
            is_visible = (torch.arange(k.shape[2], device=k.device)
                          <= torch.arange(cache.start, cache.start + seq, device=k.device)[:, None])  # [S, L]
            out = F.scaled_dot_product_attention(q.transpose(1, 2), k, v, attn_mask=is_visible, enable_gqa=True)
            return self.o_proj(out.transpose(1, 2).reshape(bsz, seq, -1))
        if cache is not None:
            cache.update(k, v)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # [B, H, S, D]
        if attn_mask is not None:
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask[:, None], enable_gqa=True)
        else:
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        return self.o_proj(out.transpose(1, 2).reshape(bsz, seq, -1))

    def _exact(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cache: LayerView | None) -> torch.Tensor:
        """One attention for decode, prefill and the full forward: q [B, S, H, D] over positions 0..own; [B, S, H*D]."""
        bsz, seq = q.shape[:2]
        if cache is not None and cache.slot is None:
            k, v, _ = cache.update(k, v)  # [n, KV, L, D]
            assert cache.positions is not None
            positions = cache.positions[:, None]
        elif cache is not None and cache.start:  # append to a running sequence, over its cached positions
            k, v, _ = cache.update(k, v)
            positions = torch.arange(cache.start, cache.start + seq, device=q.device)[None, :]
        else:  # causal from position 0
            if cache is not None:
                cache.update(k, v)
            k, v = k.transpose(1, 2), v.transpose(1, 2)
            positions = torch.arange(seq, device=q.device).expand(bsz, seq)
        group = self.num_heads // self.num_kv_heads
        q = q.view(bsz, seq, self.num_kv_heads, group, self.head_dim).permute(0, 2, 3, 1, 4)  # [B, KV, G, S, D]
        out = exact.attention(q, k, v, positions, self.scale)
        return out.permute(0, 3, 1, 2, 4).reshape(bsz, seq, -1)


class MLP(nn.Module):
    def __init__(self, args: ModelArgs, precision: Numerics) -> None:
        super().__init__()
        self.gate_proj = PrecisionLinear(args.hidden_size, args.intermediate_size, False, precision, "gate_proj")
        self.up_proj = PrecisionLinear(args.hidden_size, args.intermediate_size, False, precision, "up_proj")
        self.down_proj = PrecisionLinear(args.intermediate_size, args.hidden_size, False, precision, "down_proj")
        self.gate_up = InferenceWeights(self.gate_proj, self.up_proj)
        self.precision = precision

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if is_inference(self.gate_proj):
            gate, up = self.gate_up.linear(x).chunk(2, dim=-1)
            silu = exact.silu if use_exact(self.precision) else F.silu
            return self.down_proj(silu(gate) * up)
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, args: ModelArgs, precision: Numerics) -> None:
        super().__init__()
        self.self_attn = Attention(args, precision)
        self.mlp = MLP(args, precision)
        self.input_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps, precision)
        self.post_attention_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps, precision)

    def forward(self, x: torch.Tensor, rope: Rope, cache: LayerView | None,
                attn_mask: torch.Tensor | None = None) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), rope, cache, attn_mask)
        return x + self.mlp(self.post_attention_layernorm(x))


class LayerView:
    """Where one forward writes its K/V: slots [0, n) decoding one token each, or prefill of positions
    `start`, start + 1, ... into `slot`: one slot, or a tensor of slots (one per batch row, right-padded rows,
    from start 0). start > 0 appends to a sequence already in the slot, e.g. an environment's observation.

    `rows`, `positions`, `length` and `blocked` are shared by every layer of one forward; `blocked`
    [n, 1, 1, L] marks cache positions past a sequence's own. `attention_kernel` is the KVCache's.
    """

    def __init__(
        self,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        slot: int | torch.Tensor | None,
        rows: torch.Tensor | None = None,
        positions: torch.Tensor | None = None,
        length: int = 0,
        blocked: torch.Tensor | None = None,
        start: int = 0,
        attention_kernel: bool = False,
    ) -> None:
        self.k_cache, self.v_cache, self.slot, self.start = k_cache, v_cache, slot, start
        self.attention_kernel = attention_kernel
        self.rows, self.positions, self.length, self.blocked = rows, positions, length, blocked

    def update(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """k, v: [B, S, KV, D]. Prefill from 0 returns k, v as given; an append and decode return cache views."""
        if self.slot is not None:  # prefill: positions start..start+S-1 of each row's slot
            end = self.start + k.shape[1]
            slots = self.slot if isinstance(self.slot, torch.Tensor) else slice(self.slot, self.slot + 1)
            self.k_cache[slots, :, self.start : end] = k.transpose(1, 2)
            self.v_cache[slots, :, self.start : end] = v.transpose(1, 2)
            if self.start:
                return self.k_cache[slots, :, :end], self.v_cache[slots, :, :end], None
            return k, v, None
        assert self.rows is not None and self.positions is not None
        n, length = self.rows.shape[0], self.length
        self.k_cache[self.rows, :, self.positions] = k[:, 0]
        self.v_cache[self.rows, :, self.positions] = v[:, 0]
        return self.k_cache[:n, :, :length], self.v_cache[:n, :, :length], self.blocked


class CausalLM(nn.Module):
    """Module names mirror HF's (`model.layers.N.self_attn.q_proj`), so state dicts load as they are."""

    def __init__(self, args: ModelArgs, precision: Numerics | None = None) -> None:
        super().__init__()
        self.args = args
        self.precision = precision or Numerics()
        self.model = nn.Module()
        self.model.embed_tokens = nn.Embedding(args.vocab_size, args.hidden_size)
        self.model.layers = nn.ModuleList(DecoderLayer(args, self.precision) for _ in range(args.num_layers))
        self.model.norm = RMSNorm(args.hidden_size, args.rms_norm_eps, self.precision)
        self.lm_head = nn.Linear(args.hidden_size, args.vocab_size, bias=False)
        if args.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        inv_freq, scale = inv_freq_and_scale(args.head_dim, args.rope_theta, args.rope_scaling,
                                             args.max_position_embeddings)
        freqs = torch.arange(args.max_position_embeddings).float()[:, None] * inv_freq.float()
        emb = torch.cat((freqs, freqs), dim=-1)  # [L, D]: a table over every position the model takes
        cos, sin = emb.cos(), emb.sin()
        if scale != 1.0:  # yarn's attention factor scales cos and sin
            cos, sin = cos * scale, sin * scale
        half = emb.shape[-1] // 2
        self.no_string: torch.Tensor | None  # [V] ids the tokenizer has no string for (mask_ids_past)
        self.register_buffer("no_string", None, persistent=False)  # a buffer: it follows the model's device
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_signed_sin", torch.cat((-sin[:, :half], sin[:, half:]), dim=-1), persistent=False)

    def _rope(self, positions: torch.Tensor) -> Rope:
        """cos and signed sin for positions [B, S], gathered from the table."""
        return self.rope_cos[positions][:, :, None], self.rope_signed_sin[positions][:, :, None]

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor | None = None,
        cache: KVCache | None = None,
        slot: int | torch.Tensor | None = None,
        attn_mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Logits [B, S, V] in fp32: `logits(hidden(...))`, with the arguments of `hidden`."""
        return self.logits(self.hidden(input_ids, positions, cache, slot, attn_mask))

    def hidden(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor | None = None,
        cache: KVCache | None = None,
        slot: int | torch.Tensor | None = None,
        attn_mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """The final norm's output [B, S, H], which `logits` maps to the vocabulary: callers that need few positions,
        or the vocabulary a chunk at a time, take this and call `logits` on what they need.

        No cache: a causal full-sequence forward (training, scoring), or with `attn_mask` [B, S, S] (True where
        query row s may see key column s') and `positions` [B, S] any other attention pattern, such as the
        trainer's groups packed behind one shared prompt (not on the exact backend). With a cache and `slot`: prefill
        one sequence [1, S] into that slot at consecutive `positions` [S] (from 0, or appended after the
        slot's cached positions 0..positions[0]-1); a tensor of slots [B] prefills B right-padded sequences
        [B, S] from position 0, one per slot (padding writes only cache positions that decode overwrites
        before it reads them). With a cache and no slot: decode one token [n, 1] for slots 0..n-1 at
        `positions` [n].
        """
        bsz, seq = input_ids.shape
        if positions is None:
            positions = torch.arange(seq, device=input_ids.device).expand(bsz, seq)
        elif positions.dim() == 1:
            positions = positions[:, None] if slot is None else positions[None, :]
        if cache is not None and slot is None:
            return self._decode_hidden(input_ids, positions[:, 0], cache, int(positions.max()) + 1)
        rope = self._rope(positions)
        views: list[LayerView | None] = [None] * len(self.model.layers)
        if cache is not None:
            start = int(positions[0, 0])
            views = [LayerView(k, v, slot, start=start) for k, v in zip(cache.k, cache.v, strict=True)]
        return self._layers(input_ids, rope, views, attn_mask)

    def decode(self, input_ids: torch.Tensor, positions: torch.Tensor, cache: KVCache, length: int) -> torch.Tensor:
        """One token [n, 1] for cache slots 0..n-1 at `positions` [n]; `length` = max(positions) + 1.

        The engine passes `length` as a Python int, so this traces into one graph under torch.compile.
        """
        return self.logits(self._decode_hidden(input_ids, positions, cache, length))

    def _decode_hidden(self, input_ids: torch.Tensor, positions: torch.Tensor, cache: KVCache,
                       length: int) -> torch.Tensor:
        blocked = (torch.arange(length, device=positions.device)[None, :] > positions[:, None])[:, None, None, :]
        rows = torch.arange(input_ids.shape[0], device=input_ids.device)
        views = [LayerView(k, v, None, rows, positions, length, blocked, attention_kernel=cache.attention_kernel)
                 for k, v in zip(cache.k, cache.v, strict=True)]
        return self._layers(input_ids, self._rope(positions[:, None]), views)

    def _layers(self, input_ids: torch.Tensor, rope: Rope, views: list[LayerView | None],
                attn_mask: torch.Tensor | None = None) -> torch.Tensor:
        x = self.model.embed_tokens(input_ids)
        for layer, view in zip(self.model.layers, views, strict=True):
            x = layer(x, rope, view, attn_mask)
        return self.model.norm(x)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """lm_head over hidden states [..., H]: fp32 logits [..., V], ids with no string at -inf."""
        if use_exact(self.precision):
            logits = exact.fp32_linear(hidden, self.lm_head.weight)
        else:
            logits = self.lm_head(hidden).float()
        return self.mask_no_string(logits)

    def mask_no_string(self, logits: torch.Tensor) -> torch.Tensor:
        return logits if self.no_string is None else logits.masked_fill(self.no_string, float("-inf"))

    def mask_ids_past(self, num_tokens: int) -> None:
        """Embedding rows past the tokenizer's `num_tokens` have no string: their logits are -inf in every pass, so
        rollout never samples them and the trainer's log-probs and loss never count them."""
        if num_tokens < self.args.vocab_size:
            self.no_string = torch.arange(self.args.vocab_size, device=self.lm_head.weight.device) >= num_tokens

    def inference_weights(self) -> list[InferenceWeights]:
        """The GEMM weights a no-grad forward reads: fused q/k/v and gate/up, and the linears outside a fusion (a
        fused linear's own copies are never read, and building them held 1.9 GB more at the 0.5B shape)."""
        found = [v for module in self.modules() for v in vars(module).values() if isinstance(v, InferenceWeights)]
        fused = {id(lin) for weights in found if len(weights.linears) > 1 for lin in weights.linears}
        return [weights for weights in found if len(weights.linears) > 1 or id(weights.linears[0]) not in fused]

    def mark_weights_changed(self) -> None:
        """The weights changed (an optimizer step, a loaded state): every cached rounding is stale, even one whose
        tensor kept its address and version counter."""
        for module in self.modules():
            if isinstance(module, PrecisionLinear):
                module.generation += 1

    def release_inference_weights(self) -> None:
        """Drop every inference GEMM weight's rounded and packed copies; the next no-grad forward rebuilds them."""
        for weights in self.inference_weights():
            weights.release()

    def share_inference_masters(self) -> None:
        """Declare that this model never trains (a rollout worker's, the trainer's KL reference): its block linears'
        masters become views of their rounded GEMM copies, so the weights are held once, not twice."""
        for weights in self.inference_weights():
            weights.share_masters()

    def use_unpacked_weights(self) -> None:
        """Never oneDNN-pack this model's GEMM weights: for a model whose weights change before each no-grad pass
        (the trainer's mismatch scorer), packing costs more than it saves (5.4 ms against 1.4 ms a version on the
        default model, and its passes of a few rows ran faster unpacked)."""
        for weights in self.inference_weights():
            weights.packs = False

    def refresh_inference_weights(self) -> None:
        """Re-round and repack every inference GEMM weight now (a compiled decode cannot notice a swap)."""
        for weights in self.inference_weights():
            weights.refresh()
