"""Pooling requests: embeddings and scores computed from a prompt's hidden states.

A pooling request is a prefill-only request in the same engine as generation: it is
scheduled like any prompt (continuous batching, chunked prefill, prefix-cache hits where
its pooling allows them), its rows are pooled instead of sampled, and it finishes (its KV
blocks freed) as soon as its prompt has been computed. This module holds what the host
decides and does: the settings (vLLM's `runner` / `convert` / `pooler_config`, resolved once
into a `Pooler`), the per-request `PoolingParams`, and the accumulation of a prompt's
chunks into its final vector. The device side is runtime/ops/pooling.py.

Tasks (vLLM's): "embed" (a normalized vector; `dimensions` truncates a Matryoshka
embedding first) and "classify" (a score from a classifier; the Qwen3-Reranker recipe,
vLLM's `hf_overrides={"architectures": ["Qwen3ForSequenceClassification"],
"classifier_from_token": ["no", "yes"], "is_original_qwen3_reranker": True}`, scores
sigmoid(logit("yes") - logit("no")) at the last token, which is p("yes") of a 2-way softmax).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Literal

import numpy as np

from runtime.engine.errors import InvalidRequestError
from runtime.ops.pooling import POOLING_TYPES

PoolingTask = Literal["embed", "classify"]


@dataclasses.dataclass
class PoolingParams:
    """What a pooling request asks for (vLLM's PoolingParams).

    Attributes:
        task: "embed" or "classify" (None: the engine's task).
        dimensions: keep the first `dimensions` values of a Matryoshka embedding (before
            normalizing); only where the model says it is Matryoshka-trained.
        use_activation: embed: normalize to unit length; classify: apply the sigmoid. None:
            the pooler's default (True).
        truncate_prompt_tokens: keep only this many prompt tokens (-1: max_model_len), as
            the generation requests' setting.
    """

    task: PoolingTask | None = None
    dimensions: int | None = None
    use_activation: bool | None = None
    truncate_prompt_tokens: int | None = None
    # Set by the engine (vLLM's internal field): the request's pooling reads every token.
    skip_reading_prefix_cache: bool = False

    def __post_init__(self) -> None:
        if self.task is not None and self.task not in ("embed", "classify"):
            raise InvalidRequestError(f"task must be 'embed' or 'classify', got {self.task!r}", param="task")
        if self.dimensions is not None and (isinstance(self.dimensions, bool) or not isinstance(self.dimensions, int)):
            raise InvalidRequestError(f"dimensions must be an integer, got {self.dimensions!r}", param="dimensions")
        if self.truncate_prompt_tokens is not None and (
                isinstance(self.truncate_prompt_tokens, bool) or not isinstance(self.truncate_prompt_tokens, int)
                or self.truncate_prompt_tokens < -1):
            raise InvalidRequestError("truncate_prompt_tokens must be an integer >= -1",
                                      param="truncate_prompt_tokens")

    def clone(self, **changes: Any) -> "PoolingParams":
        return dataclasses.replace(self, **changes)


@dataclasses.dataclass(frozen=True)
class Pooler:
    """How one engine pools, decided once at startup (`resolve_pooler`).

    Attributes:
        task: what its pooled rows are for ("embed" or "classify").
        pooling_type: LAST, MEAN or CLS: which tokens' hidden states make the vector.
        use_activation: default of PoolingParams.use_activation (normalize / sigmoid).
        classifier_token_ids: classify with the LM head's rows of these tokens (vLLM's
            classifier_from_token, "no" then "yes"): score = sigmoid(l[1] - l[0]).
        embedding_size: the hidden size (an embedding's full dimensions).
        matryoshka: whether `dimensions` may truncate (hf config is_matryoshka or
            matryoshka_dimensions), and which values it may take (None: any up to the size).
    """

    task: PoolingTask
    pooling_type: str
    use_activation: bool
    classifier_token_ids: tuple[int, ...] | None
    embedding_size: int
    matryoshka: bool = False
    matryoshka_dimensions: tuple[int, ...] | None = None

    @property
    def reads_prefix_cache(self) -> bool:
        """LAST pooling reads only the last token's hidden state, which is always computed:
        a prefix-cache hit before it changes nothing. MEAN and CLS need every token (CLS the
        first), so their requests compute the whole prompt."""
        return self.pooling_type == "LAST" or self.classifier_token_ids is not None

    def check(self, params: PoolingParams, model_name: str) -> PoolingParams:
        """`params` with the task and activation filled in from this pooler (vLLM's
        PoolingParams.verify), or an InvalidRequestError saying what this model cannot do."""
        task = params.task or self.task
        if task != self.task:
            raise InvalidRequestError(
                f"model {model_name!r} pools for task {self.task!r}, not {task!r} (start it with "
                f"convert={task!r})", param="task")
        if params.dimensions is not None:
            if task != "embed":
                raise InvalidRequestError(f"Task {task!r} does not support dimensions", param="dimensions")
            if not self.matryoshka:
                raise InvalidRequestError(
                    f"Model {model_name!r} does not support Matryoshka embeddings; dimensions must be unset "
                    f"(received dimensions={params.dimensions}).", param="dimensions")
            if not 1 <= params.dimensions <= self.embedding_size:
                raise InvalidRequestError(
                    f"Model {model_name!r} only supports dimensions in range [1, {self.embedding_size}], "
                    f"got {params.dimensions}.", param="dimensions")
            if self.matryoshka_dimensions and params.dimensions not in self.matryoshka_dimensions:
                raise InvalidRequestError(
                    f"Model {model_name!r} only supports Matryoshka dimensions {list(self.matryoshka_dimensions)}, "
                    f"got {params.dimensions}.", param="dimensions")
        activation = self.use_activation if params.use_activation is None else bool(params.use_activation)
        return params.clone(task=task, use_activation=activation, skip_reading_prefix_cache=not self.reads_prefix_cache)

    def accumulate(self, acc: np.ndarray | None, first: int, num_tokens: int, prompt_len: int,
                   row: np.ndarray) -> np.ndarray | None:
        """A prompt's pooled state after one more computed chunk (tokens first..first+num_tokens)
        whose slot pooled to `row` (runtime/ops/pooling.py): LAST keeps the chunk that ends the
        prompt, CLS the one that starts it, MEAN sums (a chunk from token 0 starts over, as a
        preempted request computes its prompt again)."""
        if self.pooling_type == "MEAN" and self.classifier_token_ids is None:
            return row.copy() if first == 0 or acc is None else acc + row
        if self.pooling_type == "CLS" and self.classifier_token_ids is None:
            return row.copy() if first == 0 else acc
        return row.copy() if first + num_tokens == prompt_len else acc

    def finish(self, acc: np.ndarray, prompt_len: int, params: PoolingParams) -> np.ndarray | float:
        """The request's result from its pooled state: an embedding [D'] float32 (MEAN
        divided, Matryoshka-truncated, then normalized), or a classify score (float)."""
        if self.classifier_token_ids is not None:
            if len(acc) == 2:
                logit = float(acc[1] - acc[0])  # 2-way softmax as one sigmoid (vLLM's from_2_way_softmax)
                return 1.0 / (1.0 + np.exp(-logit)) if params.use_activation else logit
            return float(acc[0])
        vec = acc / prompt_len if self.pooling_type == "MEAN" else acc
        if params.dimensions is not None:
            vec = vec[:params.dimensions]
        if params.use_activation:
            vec = vec / max(float(np.linalg.norm(vec)), 1e-12)  # torch.nn.functional.normalize's eps
        return vec.astype(np.float32)


@dataclasses.dataclass
class PoolerConfig:
    """vLLM's pooler_config: how a pooling model pools (None fields: the model's default).

    Attributes:
        pooling_type: "LAST", "MEAN" or "CLS" (default LAST: a decoder's last token, as
            vLLM's default for converted decoder models and Qwen3-Embedding).
        use_activation: normalize embeddings / sigmoid of scores (default True). `normalize`
            is accepted as its older name.
        dimensions: unused by servax (requests choose their dimensions).
    """

    pooling_type: str | None = None
    use_activation: bool | None = None
    dimensions: int | None = None

    @classmethod
    def of(cls, value: "PoolerConfig | dict[str, Any] | None") -> "PoolerConfig":
        """From itself, vLLM's dict (pooling_type, use_activation or normalize, ...) or None.

        Raises:
            ValueError: an unknown key or pooling type."""
        if value is None:
            return cls()
        if isinstance(value, PoolerConfig):
            return value
        value = dict(value)
        if "normalize" in value:
            normalize = value.pop("normalize")
            value.setdefault("use_activation", normalize)
        if "seq_pooling_type" in value:  # vLLM's newer name
            seq = value.pop("seq_pooling_type")
            value.setdefault("pooling_type", seq)
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(value) - known)
        if unknown:
            raise ValueError(f"pooler_config: unknown key(s) {unknown}; known: {sorted(known | {'normalize'})}")
        config = cls(**value)
        if config.pooling_type is not None:
            config.pooling_type = str(config.pooling_type).upper()
            if config.pooling_type not in POOLING_TYPES:
                raise ValueError(f"pooler_config.pooling_type must be one of {list(POOLING_TYPES)}, "
                                 f"got {value['pooling_type']!r}")
        return config


def runner_of(runner: str, convert: str, hf_config: Any) -> str:
    """"generate" or "pooling": vLLM's runner auto picks pooling for an embedding or
    classification architecture (…Model, …ForSequenceClassification, …ForEmbedding) or a
    convert setting."""
    if runner != "auto":
        return runner
    if convert in ("embed", "classify") or getattr(hf_config, "classifier_from_token", None):
        return "pooling"
    arch = ((getattr(hf_config, "architectures", None) or [""])[0])
    if arch.endswith("LMHeadModel"):  # GPT2LMHeadModel and the like generate
        return "generate"
    return "pooling" if arch.endswith(("Model", "ForSequenceClassification", "ForEmbedding")) else "generate"


def resolve_pooler(*, convert: str, pooler_config: PoolerConfig, hf_config: Any, tokenizer: Any,
                   hidden_size: int) -> Pooler:
    """The pooler of a pooling engine: task, pooling type, activation and classifier tokens
    from the settings and the model's config (vLLM's rules, see the module docstring).

    Raises:
        ValueError: classifier tokens that are not single tokens, a classifier without a tokenizer."""
    tokens = getattr(hf_config, "classifier_from_token", None)
    arch = ((getattr(hf_config, "architectures", None) or [""])[0])
    task: PoolingTask
    if convert in ("embed", "classify"):
        task = convert  # type: ignore[assignment]
    else:
        task = "classify" if tokens or arch.endswith("ForSequenceClassification") else "embed"
    classifier = None
    if task == "classify":
        if not tokens:
            raise ValueError(
                "classify: servax scores with the LM head's rows of hf_overrides classifier_from_token (the "
                'Qwen3-Reranker recipe: {"classifier_from_token": ["no", "yes"], "is_original_qwen3_reranker": '
                "true}); a trained classification head (score.weight) is not supported natively")
        if tokenizer is None:
            raise ValueError("classifier_from_token needs the model's tokenizer")
        classifier = []
        for t in tokens:
            ids = tokenizer.encode(t, add_special_tokens=False) if isinstance(t, str) else [int(t)]
            if len(ids) != 1:
                raise ValueError(f"classifier_from_token {t!r} is {len(ids)} tokens; each must be one token")
            classifier.append(ids[0])
        if len(classifier) not in (1, 2):
            raise ValueError(f"classifier_from_token needs 1 or 2 tokens, got {len(classifier)}")
    dims = getattr(hf_config, "matryoshka_dimensions", None)
    return Pooler(
        task=task, pooling_type=pooler_config.pooling_type or "LAST",
        use_activation=True if pooler_config.use_activation is None else bool(pooler_config.use_activation),
        classifier_token_ids=tuple(classifier) if classifier else None, embedding_size=hidden_size,
        matryoshka=bool(dims) or bool(getattr(hf_config, "is_matryoshka", False)),
        matryoshka_dimensions=tuple(int(d) for d in dims) if dims else None,
    )


# -- scoring: pairs of (query, document) ------------------------------------------------
def score_pairs(data_1: Any, data_2: Any) -> list[tuple[Any, Any]]:
    """vLLM's pairing of score inputs: 1 -> 1, 1 -> N (the query repeated) or N -> N. Each
    input is text or token ids.

    Raises:
        InvalidRequestError: empty inputs, or lists of different lengths (N -> M)."""
    def as_list(data: Any) -> list[Any]:
        if isinstance(data, str) or (isinstance(data, (list, tuple)) and data and isinstance(data[0], int)):
            return [data]
        return list(data) if isinstance(data, (list, tuple)) else [data]

    queries, documents = as_list(data_1), as_list(data_2)
    if not documents:
        raise InvalidRequestError("At least one document (text_2 / documents) must be given", param="documents")
    if not queries:
        raise InvalidRequestError("At least one query (text_1 / queries) must be given", param="queries")
    if len(queries) == 1:
        queries = queries * len(documents)
    elif len(queries) != len(documents):
        raise InvalidRequestError(
            f"the queries ({len(queries)}) and documents ({len(documents)}) must pair 1 -> 1, 1 -> N or N -> N",
            param="documents")
    return list(zip(queries, documents))


def cross_encoder_prompt(query: Any, document: Any, tokenizer: Any = None, chat_template: str | None = None,
                         chat_template_kwargs: dict[str, Any] | None = None) -> Any:
    """The prompt a classify (cross-encoder) model scores for one pair, as vLLM builds it for
    an LLM used as a reranker: the query's text followed by the document's (token ids: the
    ids joined), or with `chat_template` (e.g. vLLM's examples/pooling/score/template/
    qwen3_reranker.jinja) the template rendered over messages of roles "query" and "document".

    Raises:
        InvalidRequestError: a pair mixing text and token ids, or a template on token ids."""
    if isinstance(query, str) and isinstance(document, str):
        if chat_template is None:
            return query + document
        if tokenizer is None:
            raise InvalidRequestError("a score chat template needs the model's tokenizer", param="chat_template")
        messages = [{"role": "query", "content": query}, {"role": "document", "content": document}]
        try:
            return tokenizer.apply_chat_template(messages, chat_template=chat_template, tokenize=False,
                                                 **(chat_template_kwargs or {}))
        except Exception as e:  # a template error is the request's (jinja's message says where)
            raise InvalidRequestError(f"the score chat template failed: {e}", param="chat_template") from e
    if isinstance(query, str) or isinstance(document, str):
        raise InvalidRequestError("a score pair must be two texts or two lists of token ids", param="documents")
    return list(query) + list(document)


def cosine_similarity(a: np.ndarray, b: np.ndarray) -> float:
    """What an embedding model scores a pair with (vLLM's: torch's cosine_similarity, eps 1e-8)."""
    return float(np.dot(a, b) / max(float(np.linalg.norm(a)) * float(np.linalg.norm(b)), 1e-8))
