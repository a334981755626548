"""Sampling in JAX: one vectorized function over per-request arrays.

Every row carries its own settings, so greedy and sampled, penalized and plain requests
share one compiled program per sequence bucket. Order (as vLLM): logit bias (and the
min_tokens suppression of stop tokens) -> repetition / frequency / presence penalties ->
the token mask (grammars, allowed_token_ids, bad_words; see runtime/engine/structured_output.py) ->
greedy argmax, or temperature -> top-k -> top-p -> min-p -> a Gumbel-max draw whose key
is derived from (row seed, tokens generated so far) only, so a seeded request gets the
same tokens whatever else shares its batch.

Logprobs are those of the model's raw distribution (log_softmax of the logits).
"""

from __future__ import annotations

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

from runtime.engine.sampling_params import MAX_LOGIT_BIAS, MAX_LOGPROB_TOKEN_IDS, MAX_STOP_TOKEN_IDS

# Width of the per-row bias table: user logit_bias plus the ids suppressed by min_tokens
# (stop token ids and a few EOS ids).
BIAS_WIDTH = MAX_LOGIT_BIAS + MAX_STOP_TOKEN_IDS + 4
SUPPRESS = -1e30  # the bias that keeps a token from being sampled (min_tokens' stop tokens)


@flax.struct.dataclass
class SamplingBatch:
    """Per-row sampling settings for S rows (padded rows are greedy and ignored)."""

    temperature: jax.Array  # [S] float32, 0 = greedy
    top_k: jax.Array  # [S] int32, 0 = off
    top_p: jax.Array  # [S] float32
    min_p: jax.Array  # [S] float32
    presence_penalty: jax.Array  # [S] float32
    frequency_penalty: jax.Array  # [S] float32
    repetition_penalty: jax.Array  # [S] float32
    seeds: jax.Array  # [S] uint32
    steps: jax.Array  # [S] int32, tokens the row's sequence generated so far
    bias_ids: jax.Array  # [S, BIAS_WIDTH] int32, -1 = unused
    bias_values: jax.Array  # [S, BIAS_WIDTH] float32
    token_history: jax.Array  # [S, H] int32 prompt then output tokens, -1 padded (penalties)
    prompt_lens: jax.Array  # [S] int32, history entries before this index are prompt
    target_ids: jax.Array  # [S] int32, token whose logprob to report instead of the sample, -1 = none
    report: jax.Array  # [S] bool, the row's logprobs are read (logprobs asked for, or a prompt-logprob row)
    logprob_ids: jax.Array  # [S, MAX_LOGPROB_TOKEN_IDS] int32: ids whose logprobs the row reports, -1 = unused
    # [S, ceil(vocab/32)] int32 packed bits, bit t%32 of word t//32 set = token t allowed
    # (all-ones rows are unconstrained; ids past the last word are allowed, so a [S, 1]
    # all-ones placeholder constrains nothing).
    token_mask: jax.Array


@flax.struct.dataclass
class SamplerOutput:
    sampled: jax.Array  # [S] int32
    chosen_logprob: jax.Array  # [S] float32, logprob of the target (or sampled) token
    chosen_rank: jax.Array  # [S] int32, 1 = most likely
    top_ids: jax.Array  # [S, K] int32
    top_logprobs: jax.Array  # [S, K] float32
    id_logprobs: jax.Array  # [S, MAX_LOGPROB_TOKEN_IDS] float32, logprobs of batch.logprob_ids (-inf unused)
    # `sampled` padded to a fixed row count, for the next step to read its input ids from
    # (async scheduling: runtime/engine/programs.py); None where the caller did not ask.
    next_ids: jax.Array | None = None


def empty_sampling_batch(num_rows: int, history_len: int, mask_words: int = 1,
                         report: bool = True) -> dict[str, np.ndarray]:
    """Host arrays for `num_rows` greedy, unconstrained rows without penalties; fill in, then
    SamplingBatch(**d). `mask_words` is ceil(vocab/32) for a mask over the whole vocabulary;
    `report` whether the rows report logprobs (the runner starts from False and marks rows)."""
    s = num_rows
    return dict(
        temperature=np.zeros(s, np.float32),
        top_k=np.zeros(s, np.int32),
        top_p=np.ones(s, np.float32),
        min_p=np.zeros(s, np.float32),
        presence_penalty=np.zeros(s, np.float32),
        frequency_penalty=np.zeros(s, np.float32),
        repetition_penalty=np.ones(s, np.float32),
        seeds=np.zeros(s, np.uint32),
        steps=np.zeros(s, np.int32),
        bias_ids=np.full((s, BIAS_WIDTH), -1, np.int32),
        bias_values=np.zeros((s, BIAS_WIDTH), np.float32),
        token_history=np.full((s, history_len), -1, np.int32),
        prompt_lens=np.zeros(s, np.int32),
        target_ids=np.full(s, -1, np.int32),
        report=np.full(s, report, np.bool_),
        logprob_ids=np.full((s, MAX_LOGPROB_TOKEN_IDS), -1, np.int32),
        token_mask=np.full((s, mask_words), -1, np.int32),
    )


def _apply_bias(logits: jax.Array, b: SamplingBatch) -> jax.Array:
    num_rows, vocab = logits.shape
    rows = jnp.arange(num_rows)[:, None]
    bias_ids = jnp.where(b.bias_ids >= 0, b.bias_ids, vocab)  # out of range -> dropped
    return logits.at[rows, bias_ids].add(b.bias_values, mode="drop")


def _apply_penalties(logits: jax.Array, b: SamplingBatch) -> jax.Array:
    num_rows, vocab = logits.shape
    rows = jnp.arange(num_rows)[:, None]

    hist = b.token_history
    valid = hist >= 0
    is_output = valid & (jnp.arange(hist.shape[1])[None, :] >= b.prompt_lens[:, None])
    hist_ids = jnp.where(valid, hist, vocab)
    counts = jnp.zeros_like(logits).at[rows, hist_ids].add(is_output.astype(logits.dtype), mode="drop")
    seen = jnp.zeros(logits.shape, jnp.bool_).at[rows, hist_ids].set(True, mode="drop")

    rep = b.repetition_penalty[:, None]
    logits = jnp.where(seen, jnp.where(logits > 0, logits / rep, logits * rep), logits)
    logits = logits - b.frequency_penalty[:, None] * counts
    logits = logits - b.presence_penalty[:, None] * (counts > 0).astype(logits.dtype)
    return logits


def _apply_token_mask(logits: jax.Array, token_mask: jax.Array) -> jax.Array:
    """-inf where the packed mask's bit is clear (ids past the mask's last word are allowed)."""
    num_rows, vocab = logits.shape
    bits = (token_mask[:, :, None] >> jnp.arange(32, dtype=jnp.int32)) & 1  # [S, W, 32]
    allowed = bits.reshape(num_rows, -1)[:, :vocab].astype(jnp.bool_)
    if allowed.shape[1] < vocab:
        allowed = jnp.pad(allowed, ((0, 0), (0, vocab - allowed.shape[1])), constant_values=True)
    return jnp.where(allowed, logits, -jnp.inf)


def _apply_token_masks_if_any(logits: jax.Array, token_mask: jax.Array) -> jax.Array:
    """The token mask where some row is constrained (a word not all ones); otherwise the
    logits untouched, without a pass over the vocabulary. A runtime condition rather than a
    static flag: one sampler program serves constrained and free batches (half the programs
    to compile at start), and a free batch still runs no mask code."""
    return jax.lax.cond(jnp.any(token_mask != -1), _apply_token_mask, lambda x, _: x, logits, token_mask)


def _sortable(x: jax.Array) -> jax.Array:
    """float32 -> uint32 keys in the same order (so thresholds can be searched bit-exactly)."""
    bits = jax.lax.bitcast_convert_type(x, jnp.uint32)
    return jnp.where(bits >> 31 == 1, ~bits, bits | jnp.uint32(1 << 31))


def _search_threshold(keys: jax.Array, keep_all_above) -> jax.Array:
    """Per row, the smallest key t in [0, max key] with keep_all_above(t) true ([S] uint32).

    `keep_all_above(t [S, 1]) -> [S] bool` must be monotone (false, then true as t grows)
    and true at each row's largest key. 32 halvings of the uint32 range find t exactly:
    no sort of the vocabulary (a [32, 49k] sort costs ~0.7 s on XLA:CPU; this ~ms).
    """
    lo = jnp.zeros(keys.shape[:1], jnp.uint32)
    hi = keys.max(axis=-1)

    def halve(_, bounds):
        lo, hi = bounds
        mid = lo + (hi - lo) // 2
        ok = keep_all_above(mid[:, None])
        return jnp.where(ok, lo, mid + 1), jnp.where(ok, mid, hi)

    return jax.lax.fori_loop(0, 32, halve, (lo, hi))[1]


def _truncate(logits: jax.Array, b: SamplingBatch, cpu_kernel: bool = False) -> jax.Array:
    """Mask (to -inf) what top-k, top-p and min-p exclude; logits already temperature-scaled.

    As vLLM: top-k keeps the k largest (ties with the k-th included); top-p then keeps the
    smallest set of the most likely tokens whose probability (after top-k) reaches top_p;
    min-p drops tokens below min_p x the most likely one's probability. The k-th value and
    the top-p cut are found by a bisection over the logits' bit patterns rather than a sort,
    and each search only runs when some row asks for it. With `cpu_kernel` (XLA:CPU, one
    device) both cuts come from servax's C++ kernel instead (runtime/ops/kernels/sampling.cc),
    several times faster than the bisections on XLA:CPU.
    """
    keys = _sortable(logits)
    if cpu_kernel:
        logits = _truncate_by_kernel(logits, keys, b)
    else:
        logits = _truncate_by_bisection(logits, keys, b)

    def min_p(logits):
        probs = jax.nn.softmax(logits, axis=-1)
        floor = b.min_p[:, None] * jnp.max(probs, axis=-1, keepdims=True)
        return jnp.where(probs >= floor, logits, -jnp.inf)

    return jax.lax.cond(jnp.any(b.min_p > 0.0), min_p, lambda x: x, logits)


def _truncate_by_kernel(logits: jax.Array, keys: jax.Array, b: SamplingBatch) -> jax.Array:
    """Top-k and top-p as one key cut per row from the C++ kernel (same definition as below)."""
    from runtime.ops.cpu_kernels import TRUNCATION_TARGET

    def cut(logits):
        call = jax.ffi.ffi_call(TRUNCATION_TARGET, jax.ShapeDtypeStruct(b.top_k.shape, jnp.uint32))
        return call(logits.astype(jnp.float32), b.top_k.astype(jnp.int32), b.top_p.astype(jnp.float32))

    none = lambda logits: jnp.zeros(b.top_k.shape, jnp.uint32)  # noqa: E731 - every key is >= 0
    threshold = jax.lax.cond(jnp.any(b.top_k > 0) | jnp.any(b.top_p < 1.0), cut, none, logits)
    return jnp.where(keys >= threshold[:, None], logits, -jnp.inf)


def _truncate_by_bisection(logits: jax.Array, keys: jax.Array, b: SamplingBatch) -> jax.Array:
    """Top-k, then top-p, each cut found by a 32-pass bisection over the keys."""
    vocab = logits.shape[-1]

    def top_k(logits):
        k = jnp.where(b.top_k > 0, jnp.minimum(b.top_k, vocab), vocab)
        # The largest t with at least k keys >= t is the k-th key: keep keys >= it.
        # Searched as the smallest t with fewer than k keys >= t + 1 (monotone in t).
        kth = _search_threshold(keys, lambda t: jnp.sum(keys > t, axis=-1) < k)
        return jnp.where(keys >= kth[:, None], logits, -jnp.inf)

    logits = jax.lax.cond(jnp.any(b.top_k > 0), top_k, lambda x: x, logits)

    def top_p(logits):
        probs = jax.nn.softmax(logits, axis=-1)
        # A token stays when the mass of the tokens above it is below top_p; that mass only
        # falls as the token's key rises, so the kept tokens are those with key >= the
        # smallest t whose mass above is below top_p.
        cut = _search_threshold(keys, lambda t: jnp.sum(jnp.where(keys > t, probs, 0.0), axis=-1) < b.top_p)
        return jnp.where((keys >= cut[:, None]) | (b.top_p[:, None] >= 1.0), logits, -jnp.inf)

    return jax.lax.cond(jnp.any(b.top_p < 1.0), top_p, lambda x: x, logits)


def _argmax(x: jax.Array, cpu_kernel: bool = False) -> jax.Array:
    """jnp.argmax over the last axis (the first index of the maximum; the vocabulary size where a
    row holds a NaN), as a max then a min over indices: XLA:CPU runs argmax's (value, index)
    reduction several times slower when the values are computed in the same fusion (as the
    Gumbel draw's are). With `cpu_kernel`, by the C++ kernel (runtime/ops/kernels/sampling.cc):
    XLA:CPU's two passes cost a lone decode ~0.1 ms, a visible part of its step."""
    if cpu_kernel:
        from runtime.ops.cpu_kernels import ARGMAX_TARGET

        rows = x.reshape(-1, x.shape[-1]).astype(jnp.float32)
        ids = jax.ffi.ffi_call(ARGMAX_TARGET, jax.ShapeDtypeStruct(rows.shape[:1], jnp.int32))(rows)
        return ids.reshape(x.shape[:-1])
    top = x.max(axis=-1, keepdims=True)
    return jnp.min(jnp.where(x == top, jnp.arange(x.shape[-1], dtype=jnp.int32), x.shape[-1]), axis=-1)


def _mix32(h: jax.Array) -> jax.Array:
    """MurmurHash3's 32-bit finalizer: a bijection of uint32 with full avalanche."""
    h = (h ^ (h >> 16)) * jnp.uint32(0x85EBCA6B)
    h = (h ^ (h >> 13)) * jnp.uint32(0xC2B2AE35)
    return h ^ (h >> 16)


def _gumbel_noise(seeds: jax.Array, steps: jax.Array, vocab: int) -> jax.Array:
    """Gumbel(0, 1) noise [S, vocab], a pure function of (row seed, step, token id).

    A counter-based hash (SplitMix-style: a per-row key, then the token id times the golden
    ratio, finalized by MurmurHash3's mixer) rather than jax.random's threefry, which costs
    about ten times as much per draw inside the sampler on XLA:CPU. Because it
    depends on nothing else, a seeded request draws the same tokens in any batch.
    """
    row = _mix32(seeds.astype(jnp.uint32) ^ _mix32(steps.astype(jnp.uint32) + jnp.uint32(0x9E3779B9)))
    counter = jnp.arange(vocab, dtype=jnp.uint32)[None, :] * jnp.uint32(0x9E3779B9)
    bits = _mix32(_mix32(row[:, None] + counter))
    uniform = ((bits >> 8).astype(jnp.float32) + 0.5) * (1.0 / (1 << 24))  # in (0, 1)
    return -jnp.log(-jnp.log(uniform))


def sample(
    logits: jax.Array, batch: SamplingBatch, *, num_logprobs: int, use_penalties: bool = True,
    cpu_kernel: bool = False,
) -> SamplerOutput:
    """Choose one token per row and report logprobs.

    Args:
        logits: [S, vocab] model output for each row.
        batch: per-row settings (see SamplingBatch).
        num_logprobs: K, how many top logprobs to return per row (static).
        use_penalties: apply repetition / frequency / presence penalties (static). Without
            them `token_history` may be a [S, 1] placeholder, so batches that need no
            penalties neither ship nor scan a [S, max_model_len] history.
        When every row is greedy (temperature <= 0, as padding rows are) the program skips
        truncation and the random draw at run time, so one program per bucket serves greedy
        and sampled batches alike at the greedy program's cost.
        cpu_kernel: cut top-k / top-p and take the argmax with the C++ kernels (static; XLA:CPU
            on one device, once runtime.ops.cpu_kernels says the truncation kernel is available).

    `token_mask` applies when some row's mask is not all ones (see _apply_token_masks_if_any).
    A batch of plain greedy rows (no bias, mask or penalty) takes the argmax of the logits as
    they came: a branch that changes them would copy the program's argument first, a step's
    largest cost after the argmax on XLA:CPU.
    """
    logits = logits.astype(jnp.float32)
    is_greedy = batch.temperature <= 0.0

    def processed_sample(logits: jax.Array) -> jax.Array:
        processed = _apply_bias(logits, batch)
        if use_penalties:
            processed = _apply_penalties(processed, batch)
        processed = _apply_token_masks_if_any(processed, batch.token_mask)
        greedy = _argmax(processed, cpu_kernel)

        def draw(processed: jax.Array) -> jax.Array:
            temp = jnp.where(is_greedy, 1.0, batch.temperature)
            scaled = _truncate(processed / temp[:, None], batch, cpu_kernel)
            gumbel = _gumbel_noise(batch.seeds, batch.steps, logits.shape[-1])
            return jnp.where(is_greedy, greedy, _argmax(scaled + gumbel, cpu_kernel))

        return jax.lax.cond(jnp.all(is_greedy), lambda _: greedy, draw, processed)

    if use_penalties:
        sampled = processed_sample(logits)
    else:
        plain = jnp.all(is_greedy) & ~jnp.any(batch.bias_ids >= 0) & jnp.all(batch.token_mask == -1)
        sampled = jax.lax.cond(plain, lambda x: _argmax(x, cpu_kernel), processed_sample, logits)
    return _report(logits, sampled, batch, num_logprobs)


def _report(logits: jax.Array, sampled: jax.Array, batch: SamplingBatch, num_logprobs: int) -> SamplerOutput:
    """The sample with the raw distribution's logprobs (log_softmax of the logits): the chosen
    (target or sampled) token's logprob and rank, the top K, and the logprobs of the ids a row
    names (batch.logprob_ids: vLLM's logprob_token_ids). Zeros (rank 1) when no row
    reports any (batch.report), without a pass over the vocabulary: most steps serve requests
    that ask for no logprobs, and the top-K alone is a visible part of a decode step on XLA:CPU."""
    chosen = jnp.where(batch.target_ids >= 0, batch.target_ids, sampled)

    def logprobs(logits: jax.Array) -> tuple[jax.Array, ...]:
        raw = jax.nn.log_softmax(logits, axis=-1)
        chosen_logprob = jnp.take_along_axis(raw, chosen[:, None], axis=-1)[:, 0]
        chosen_rank = 1 + jnp.sum(raw > chosen_logprob[:, None], axis=-1).astype(jnp.int32)
        top_logprobs, top_ids = jax.lax.top_k(raw, num_logprobs)
        ids = batch.logprob_ids
        by_id = jnp.where(ids >= 0, jnp.take_along_axis(raw, jnp.maximum(ids, 0), axis=-1), -jnp.inf)
        return chosen_logprob, chosen_rank, top_ids.astype(jnp.int32), top_logprobs, by_id

    def unread(logits: jax.Array) -> tuple[jax.Array, ...]:
        s = logits.shape[0]
        return (jnp.zeros(s, jnp.float32), jnp.ones(s, jnp.int32), jnp.zeros((s, num_logprobs), jnp.int32),
                jnp.zeros((s, num_logprobs), jnp.float32), jnp.full((s, MAX_LOGPROB_TOKEN_IDS), -jnp.inf))

    return SamplerOutput(sampled, *jax.lax.cond(jnp.any(batch.report), logprobs, unread, logits))
