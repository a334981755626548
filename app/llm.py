"""The offline API: `LLM(model=...).generate(prompts, sampling_params)`, as vLLM's.

    from app import LLM, SamplingParams

    llm = LLM(model="servax-tiny/llama", max_model_len=512)
    outs = llm.generate(["Hello", "The sea"], SamplingParams(temperature=0, max_tokens=16))
    print(outs[0].outputs[0].text)
    chat = llm.chat([{"role": "user", "content": "Hi!"}], SamplingParams(max_tokens=16))

It lives beside the Serve app rather than in runtime/ because it loads the model
(registry.load) and hands it to the engine; the engine never looks for a model itself.
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from tqdm.auto import tqdm

import registry
from registry.model_info import sampling_defaults
from app.serving_config import split_engine_kwargs
from runtime.engine import distributed
from runtime.engine.config import EngineConfig
from runtime.engine.core import Engine
from runtime.engine.lora_request import LoRARequest
from runtime.ops.mesh import make_mesh
from runtime.engine.outputs import (
    EmbeddingRequestOutput, PoolingRequestOutput, RequestOutput, ScoringOutput, ScoringRequestOutput,
)
from runtime.engine.pooling import PoolingParams, cosine_similarity, cross_encoder_prompt, score_pairs
from runtime.engine.input_processor import ChatPrompt, PromptType, is_chat
from runtime.engine.sampling_params import SamplingParams
from runtime.ops.step import LoadedModel


def load_model(config: EngineConfig) -> LoadedModel:
    """Load `config.model` the way the engine will run it: on the mesh its settings ask for.

    A mesh larger than this process's devices makes this process the leader of a
    multi-process engine (runtime/engine/distributed.py): the worker processes join and load their
    shards while this one loads its own.

    Raises:
        registry.errors.ModelLoadError: the model cannot be resolved or loaded.
        ValueError: the devices cannot hold the mesh.
    """
    distributed.connect(config, load_model)  # a mesh over several processes: the workers join and load
    model = registry.load(
        config.model, model_impl=config.model_impl, dtype=config.dtype,
        mesh=make_mesh(config.tensor_parallel_size, config.data_parallel_size),
        revision=config.revision, trust_remote_code=config.trust_remote_code, tokenizer=config.tokenizer,
        tokenizer_mode=config.tokenizer_mode, skip_tokenizer_init=config.skip_tokenizer_init,
        hf_overrides=config.hf_overrides, quantization=config.quantization,
        # the layers as the layered step takes them (LoRA slots are added to stacked layers)
        layered=config.layered and not config.enable_lora,
        expert_parallel=config.enable_expert_parallel,
    )
    if config.generation_config not in ("auto", "vllm"):  # a folder holding generation_config.json
        model.generation_config = sampling_defaults(Path(config.generation_config).expanduser())
    return model


class LLM:
    """An engine for batch generation in this process.

    Args:
        model: model ID, local folder or servax-tiny/<name>.
        loaded_model: an already loaded LoadedModel to serve instead of loading `model`.
        **engine_kwargs: any EngineConfig field (model_impl, dtype, max_model_len, ...); the
            OpenAI routes' settings (tool_call_parser, ...) are accepted as in a YAML
            block's engine_kwargs, and kept as `serving_config` (offline generation reads none).

    Raises:
        registry.errors.ModelLoadError, ValueError (pydantic's ValidationError for a bad setting).
    """

    def __init__(self, model: str, *, loaded_model: LoadedModel | None = None, **engine_kwargs: Any):
        engine_kwargs, self.serving_config = split_engine_kwargs(engine_kwargs)
        self.config = EngineConfig(model=model, **engine_kwargs)
        self.engine = Engine(self.config, loaded_model if loaded_model is not None else load_model(self.config))
        self.engine.ahead.max_step_s = float("inf")  # offline: no request arrives while steps run ahead
        self._ids = itertools.count()

    def shutdown(self) -> None:
        """Stop the worker processes of a multi-process engine (also done at interpreter exit)."""
        self.engine.shutdown()

    @property
    def tokenizer(self) -> Any:
        return self.engine.tokenizer

    def get_tokenizer(self) -> Any:
        """The model's tokenizer (vLLM's name), or None with skip_tokenizer_init."""
        return self.engine.tokenizer

    def get_default_sampling_params(self) -> SamplingParams:
        """What a request that sets nothing gets: the model's generation_config defaults (vLLM's name)."""
        return self.engine.processor.sampling_params(None)

    def generate(
        self,
        prompts: PromptType | Sequence[PromptType],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        """Generate for every prompt; returns final outputs in prompt order.

        A prompt is text, token ids, or a prompt dict ({"prompt": ...} or
        {"prompt_token_ids": [...]}); pass one or a list. `sampling_params` is one
        SamplingParams for all, or one per prompt; None takes get_default_sampling_params().
        `lora_request`: a LoRA adapter for all prompts, or one (or None) per prompt (needs
        enable_lora).

        Raises:
            InvalidRequestError / PromptTooLongError: before anything is queued.
        """
        return self._run([prompts] if _single_prompt(prompts) else list(prompts), sampling_params, use_tqdm,
                         lora_request)

    def beam_search(self, *args: Any, **kwargs: Any) -> Any:
        """vLLM's LLM.beam_search: not implemented by servax.

        Raises:
            NotImplementedError: always (sample n sequences with logprobs instead).
        """
        raise NotImplementedError("servax does not implement beam search (vLLM's LLM.beam_search, use_beam_search); "
                                  "sample n sequences instead (SamplingParams(n=..., logprobs=...)) and rank them")

    def chat(
        self,
        messages: Sequence[Mapping[str, Any]] | Sequence[Sequence[Mapping[str, Any]]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        *,
        chat_template: str | None = None,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        chat_template_kwargs: Mapping[str, Any] | None = None,
        tools: Sequence[Mapping[str, Any]] | None = None,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        """Generate replies to one conversation or a list of them, rendered with the chat
        template (the model's, or `chat_template`), as vLLM's LLM.chat. `tools` (OpenAI's
        shape) reach the template; the reply is text (parse tool calls with app.tool_parsers).

        Raises:
            InvalidRequestError: the model has no chat template, or a message is malformed.
        """
        conversations = [messages] if is_chat(messages) else list(messages)
        prompts = [ChatPrompt(conversation, add_generation_prompt=add_generation_prompt,
                              continue_final_message=continue_final_message, chat_template=chat_template,
                              chat_template_kwargs=chat_template_kwargs, tools=tools)
                   for conversation in conversations]
        return self._run(prompts, sampling_params, use_tqdm, lora_request)

    def embed(
        self,
        prompts: PromptType | Sequence[PromptType],
        *,
        use_tqdm: bool = True,
        pooling_params: PoolingParams | Sequence[PoolingParams] | None = None,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[EmbeddingRequestOutput]:
        """An embedding of every prompt, in prompt order (vLLM's LLM.embed): `.outputs.embedding`.
        Needs a pooling engine (runner="pooling"; convert="embed").

        Raises:
            InvalidRequestError: a bad prompt or setting (e.g. dimensions on a model that is not
                Matryoshka-trained), or an engine that does not pool."""
        prompt_list = [prompts] if _single_prompt(prompts) else list(prompts)
        params = pooling_params or PoolingParams(task="embed")
        outs = self._pool(prompt_list, params, use_tqdm, lora_request, "servax: embedding")
        return [EmbeddingRequestOutput.from_base(o) for o in outs]

    def score(
        self,
        data_1: PromptType | Sequence[PromptType],
        data_2: PromptType | Sequence[PromptType],
        /,
        *,
        use_tqdm: bool = True,
        pooling_params: PoolingParams | None = None,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
        chat_template: str | None = None,
    ) -> list[ScoringRequestOutput]:
        """Scores of (data_1, data_2) pairs, 1 -> 1, 1 -> N or N -> N (vLLM's LLM.score):
        `.outputs.score`. A classify engine (a reranker) scores each pair's joined prompt
        (runtime.engine.pooling.cross_encoder_prompt; `chat_template` renders it); an embed
        engine scores the cosine similarity of the two embeddings.

        Raises:
            InvalidRequestError: unpaired inputs, a bad setting, an engine that does not pool."""
        pairs = score_pairs(data_1, data_2)
        pooler = self.engine.pooler
        if pooler is not None and pooler.task == "embed":
            texts = list(dict.fromkeys(_hashable(x) for pair in pairs for x in pair))
            vectors = self._pool([_prompt(t) for t in texts], pooling_params or PoolingParams(task="embed"),
                                 use_tqdm, lora_request, "servax: scoring")
            by_text = dict(zip(texts, vectors))
            outs = []
            for i, (q, d) in enumerate(pairs):
                a, b = by_text[_hashable(q)], by_text[_hashable(d)]
                outs.append(ScoringRequestOutput(
                    f"score-{i}", ScoringOutput(cosine_similarity(a.outputs.data, b.outputs.data)),
                    a.prompt_token_ids + b.prompt_token_ids))
            return outs
        prompts = [cross_encoder_prompt(q, d, self.tokenizer, chat_template) for q, d in pairs]
        outs = self._pool(prompts, pooling_params or PoolingParams(task="classify"), use_tqdm, lora_request,
                          "servax: scoring")
        return [ScoringRequestOutput(o.request_id, ScoringOutput(float(o.outputs.data[0])), o.prompt_token_ids,
                                     o.finished, o.num_cached_tokens) for o in outs]

    def _pool(self, prompt_list: list[PromptType], pooling_params: Any, use_tqdm: bool, lora_request: Any,
              desc: str) -> list[PoolingRequestOutput]:
        """Run pooling requests to completion; their outputs in prompt order."""
        if isinstance(pooling_params, PoolingParams):
            params_list = [pooling_params] * len(prompt_list)
        else:
            params_list = list(pooling_params)
            if len(params_list) != len(prompt_list):
                raise ValueError(f"{len(prompt_list)} prompts but {len(params_list)} pooling params")
        lora_list = ([lora_request] * len(prompt_list) if lora_request is None or isinstance(lora_request, LoRARequest)
                     else list(lora_request))
        processed = [
            self.engine.process_inputs(f"llm-{next(self._ids)}", p, pp, enforce_queue_limit=False, lora_request=lora)
            for p, pp, lora in zip(prompt_list, params_list, lora_list)
        ]
        for req in processed:
            self.engine.add_processed(req)
        finals: dict[str, PoolingRequestOutput] = {}
        bar = tqdm(total=len(processed), desc=desc, disable=not use_tqdm)
        while self.engine.has_unfinished_requests():
            for out in self.engine.step():
                if out.finished:
                    finals[out.request_id] = out
                    bar.update(1)
        bar.close()
        return [finals[req.request_id] for req in processed]

    def _run(self, prompt_list: list[PromptType], sampling_params: Any, use_tqdm: bool,
             lora_request: Any = None) -> list[RequestOutput]:
        if sampling_params is None:  # vLLM's: the defaults for generate and chat alike
            sampling_params = self.get_default_sampling_params()
        if isinstance(sampling_params, SamplingParams):
            params_list = [sampling_params] * len(prompt_list)
        else:
            params_list = list(sampling_params)
            if len(params_list) != len(prompt_list):
                raise ValueError(f"{len(prompt_list)} prompts but {len(params_list)} sampling params")
        # Validate everything first so that a bad prompt queues nothing. Offline batches may
        # be larger than the serving queue limit.
        if lora_request is None or isinstance(lora_request, LoRARequest):
            lora_list = [lora_request] * len(prompt_list)
        else:
            lora_list = list(lora_request)
            if len(lora_list) != len(prompt_list):
                raise ValueError(f"{len(prompt_list)} prompts but {len(lora_list)} lora requests")
        processed = [
            self.engine.process_inputs(f"llm-{next(self._ids)}", p, sp, enforce_queue_limit=False, lora_request=lora)
            for p, sp, lora in zip(prompt_list, params_list, lora_list)
        ]
        for req in processed:
            self.engine.add_processed(req)
        finals: dict[str, RequestOutput] = {}
        bar = tqdm(total=len(processed), desc="servax: generating", disable=not use_tqdm)
        while self.engine.has_unfinished_requests():
            for out in self.engine.step():
                if out.finished:
                    finals[out.request_id] = out
                    bar.update(1)
        bar.close()
        return [finals[req.request_id] for req in processed]


def _single_prompt(prompts: Any) -> bool:
    """One prompt (text, a prompt dict or token ids), not a list of them."""
    return isinstance(prompts, (str, Mapping)) or (
        isinstance(prompts, (list, tuple)) and bool(prompts) and isinstance(prompts[0], int))


def _hashable(data: Any) -> Any:
    """A score input as a dict key (token ids as a tuple)."""
    return data if isinstance(data, str) else tuple(data)


def _prompt(key: Any) -> PromptType:
    return key if isinstance(key, str) else list(key)
