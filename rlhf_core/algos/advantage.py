"""Generalized Advantage Estimation (Schulman et al. 2016, https://arxiv.org/abs/1506.02438).

Masked-step semantics follow verl's ``compute_gae_advantage_return``: walking t = T-1 .. 0,

    delta       = r_t + gamma * nextvalue - v_t
    lastgaelam' = delta + gamma * lam * lastgaelam
    nextvalue   = v_t         if m_t else nextvalue      # carried through masked steps
    lastgaelam  = lastgaelam' if m_t else lastgaelam

with nextvalue = lastgaelam = 0 after the end (no bootstrap). A masked step is therefore
invisible: it neither discounts nor contributes reward. Equivalently, per row, GAE runs on the
*compacted* sequence of valid tokens only. ``compute_gae`` uses exactly that view: it scatters
valid tokens to the left, evaluates the discounted reverse cumulative sum with the uniform
discount gamma * lam by blocked matrix products, and gathers the result back to the original
positions: no Python loop over t, and no (gamma * lam)**-t factor that could overflow.
"""

from __future__ import annotations

import functools
from typing import Union

import torch

from .registry import register_adv_estimator

Scalar = Union[float, torch.Tensor]

# Block length of the two-level scan: work is O(B*T*L) for the in-block products plus a
# recursive scan over T/L block heads; 64 keeps every matmul cache-sized on CPU and GPU.
_BLOCK = 64
# Rows per chunk are chosen so the scratch space stays around this many bytes (see compute_gae).
_WORKSPACE_BYTES = 8 << 20


def _compute_dtype(*tensors: torch.Tensor) -> torch.dtype:
    dtype = tensors[0].dtype
    for t in tensors[1:]:
        dtype = torch.promote_types(dtype, t.dtype)
    # Sums over hundreds of tokens lose most of bf16/fp16's 8-11 mantissa bits.
    return torch.float32 if dtype in (torch.bfloat16, torch.float16) or not dtype.is_floating_point else dtype


def _discount_matrix(rho: Scalar, n: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """W[q, p] = rho**(q - p) for q >= p else 0, so ``(x @ W)[p] = sum_{q>=p} rho**(q-p) x[q]``.

    Exponents are built directly and are never negative, so nothing overflows for rho < 1
    (unlike the ``rho**-t * cumsum(rho**t * x)`` trick); tiny powers just underflow to 0.
    """
    if isinstance(rho, (int, float)):
        return _cached_discount_matrix(float(rho), n, dtype, device)
    return _build_discount_matrix(rho, n, dtype, device)


def _build_discount_matrix(rho: Scalar, n: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    idx = torch.arange(n, device=device)
    exponent = idx.unsqueeze(1) - idx.unsqueeze(0)
    powers = torch.pow(torch.as_tensor(rho, dtype=dtype, device=device), exponent.clamp(min=0).to(dtype))
    return torch.where(exponent >= 0, powers, torch.zeros((), dtype=dtype, device=device))


# Training uses one (gamma, lam) for the whole run; only ever read, never written.
_cached_discount_matrix = functools.lru_cache(maxsize=32)(_build_discount_matrix)


def _scan_width(length: int, block: int) -> int:
    """Columns for ``length`` tokens plus one spare zero column, rounded up to whole blocks."""
    return length + 1 if length + 1 <= block else -(-(length + 1) // block) * block


def _scan_into(x: torch.Tensor, rho: Scalar, block: int, out: torch.Tensor) -> torch.Tensor:
    """Write y_t = sum_{s >= t} rho**(s - t) x_s (along dim 1 of (B, W) ``x``) into ``out``.

    W must be <= block or a multiple of it. Blocked scan: within blocks of length L one (L, L)
    matmul gives the local sums; the block heads h_k = local_k[0] + rho**L h_{k+1} form the
    same recurrence with discount rho**L over W/L elements, solved recursively; finally
    y = local + rho**(L - p) h_{k+1} at in-block position p.
    """
    batch, width = x.shape
    if width <= block:
        return torch.matmul(x, _discount_matrix(rho, width, x.dtype, x.device), out=out)
    n_blocks = width // block
    matrix = _discount_matrix(rho, block, x.dtype, x.device)
    local = torch.matmul(x.view(batch, n_blocks, block), matrix, out=out.view(batch, n_blocks, block))
    heads = discounted_reverse_cumsum(local[:, :, 0], rho**block, block)
    next_heads = torch.nn.functional.pad(heads[:, 1:], (0, 1)).unsqueeze(-1)
    offsets = torch.arange(block, 0, -1, device=x.device).to(x.dtype)
    local.addcmul_(next_heads, torch.pow(torch.as_tensor(rho, dtype=x.dtype, device=x.device), offsets))
    return out


def discounted_reverse_cumsum(x: torch.Tensor, rho: Scalar, block: int = _BLOCK) -> torch.Tensor:
    """y_t = sum_{s >= t} rho**(s - t) x_s along the last dim of a (B, T) tensor (blocked scan)."""
    if block < 2:
        raise ValueError(f"block must be >= 2, got {block}")
    length = x.shape[-1]
    width = length if length <= block else -(-length // block) * block
    # Zero padding on the right leaves every earlier sum unchanged.
    padded = torch.nn.functional.pad(x, (0, width - length))
    return _scan_into(padded, rho, block, torch.empty_like(padded))[:, :length]


def _gae_rows(rewards, values, valid, gamma, lam, slot, buffers, adv_out, ret_out) -> None:
    """GAE for a block of rows, written into ``adv_out`` / ``ret_out`` (see compute_gae).

    ``slot`` (R, T) long and ``buffers`` (2, R, W) are scratch. Valid token t of a row moves to
    column rank(t); masked tokens all go to column W-1, which is re-zeroed, so it doubles as the
    zero value after the end and as the zero read back at masked positions.
    """
    width = buffers.shape[-1]
    torch.cumsum(valid, dim=-1, dtype=torch.long, out=slot)
    # where(out=) rather than masked_fill_: the latter is ~2x slower on CPU.
    torch.where(valid, slot.sub_(1), torch.tensor(width - 1, device=slot.device), out=slot)
    buffers.zero_()
    values_c, deltas_c = buffers[0], buffers[1]
    values_c.scatter_(1, slot, values)[:, -1] = 0
    deltas_c.scatter_(1, slot, rewards)[:, -1] = 0
    # delta_i = r_i + gamma * v_{i+1} - v_i; past the last valid token r = v = 0, so delta = 0.
    deltas_c.sub_(values_c)
    if isinstance(gamma, torch.Tensor):
        deltas_c[:, :-1].add_(gamma * values_c[:, 1:])
    else:
        deltas_c[:, :-1].add_(values_c[:, 1:], alpha=gamma)
    # values_c is no longer needed: reuse it for the scan output.
    scanned = _scan_into(deltas_c, gamma * lam, _BLOCK, out=values_c)
    torch.gather(scanned, 1, slot, out=adv_out)
    torch.add(adv_out, values, out=ret_out)
    torch.where(valid, ret_out, torch.zeros((), dtype=ret_out.dtype, device=ret_out.device), out=ret_out)


@register_adv_estimator("gae")
def compute_gae(
    *,
    token_level_rewards: torch.Tensor,
    values: torch.Tensor,
    response_mask: torch.Tensor,
    gamma: Scalar,
    lam: Scalar,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Vectorised GAE, identical in value to ``compute_gae_reference``.

    Args: ``token_level_rewards``, ``values``, ``response_mask``: (B, T); ``gamma``, ``lam``:
    floats or 0-dim tensors.
    Returns ``(advantages, returns)``, both (B, T), ``returns = advantages + values``; both are
    0 at masked positions. With i indexing the valid tokens of a row in order,
    ``delta_i = r_i + gamma * v_{i+1} - v_i`` (v past the last valid token = 0) and
    ``A_i = sum_{j >= i} (gamma * lam)**(j - i) * delta_j``. No whitening here: callers
    whiten with ``masked_whiten`` if they want to.
    """
    with torch.no_grad():
        dtype = _compute_dtype(token_level_rewards, values)
        rewards, vals = token_level_rewards.to(dtype).contiguous(), values.to(dtype).contiguous()
        valid = (response_mask if response_mask.dtype == torch.bool else response_mask != 0).contiguous()
        batch, length = vals.shape
        width = _scan_width(length, _BLOCK)
        advantages, returns = torch.empty_like(vals), torch.empty_like(vals)
        # Row chunks share one scratch allocation, reused across chunks: on CPU, glibc hands
        # freed multi-MB blocks back to the OS and the next call page-faults them in again,
        # which costs more than all the arithmetic here.
        item = torch.empty((), dtype=dtype).element_size()
        row_bytes = 8 * length + 2 * item * width
        rows = max(1, min(batch, _WORKSPACE_BYTES // row_bytes))
        scratch = torch.empty(rows * row_bytes, dtype=torch.uint8, device=vals.device)
        slot = scratch[: rows * 8 * length].view(torch.long).view(rows, length)
        buffers = scratch[rows * 8 * length :].view(dtype).view(2, rows, width)
        for start in range(0, batch, rows):
            n = min(rows, batch - start)
            rows_ = slice(start, start + n)
            _gae_rows(
                rewards[rows_], vals[rows_], valid[rows_], gamma, lam,
                slot[:n], buffers[:, :n], advantages[rows_], returns[rows_],
            )
    return advantages.to(token_level_rewards.dtype), returns.to(token_level_rewards.dtype)


def compute_gae_reference(
    *,
    token_level_rewards: torch.Tensor,
    values: torch.Tensor,
    response_mask: torch.Tensor,
    gamma: Scalar,
    lam: Scalar,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The plain reversed loop over t (verl's recurrence, see module docstring).

    Kept as the ground truth for tests and the benchmark. Same dtype policy and output
    convention (0 at masked positions) as ``compute_gae``.
    """
    with torch.no_grad():
        dtype = _compute_dtype(token_level_rewards, values)
        rewards, vals = token_level_rewards.to(dtype), values.to(dtype)
        valid = response_mask != 0
        next_value = torch.zeros(vals.shape[0], dtype=dtype, device=vals.device)
        last_gae = torch.zeros_like(next_value)
        reversed_adv = []
        for t in reversed(range(vals.shape[-1])):
            delta = rewards[:, t] + gamma * next_value - vals[:, t]
            candidate = delta + gamma * lam * last_gae
            # where, not m*x + (1-m)*y: garbage (inf/nan) at masked steps must not leak.
            next_value = torch.where(valid[:, t], vals[:, t], next_value)
            last_gae = torch.where(valid[:, t], candidate, last_gae)
            reversed_adv.append(last_gae)
        zero = torch.zeros((), dtype=dtype, device=vals.device)
        advantages = torch.where(valid, torch.stack(reversed_adv[::-1], dim=1), zero)
        returns = torch.where(valid, advantages + vals, zero)
    return advantages.to(token_level_rewards.dtype), returns.to(token_level_rewards.dtype)
