"""The offline API: LLM(model=...).generate(prompts, sampling_params).

    llm = LLM(model="servax-tiny/llama", max_model_len=512)
    outs = llm.generate(["Hello", "The sea"], SamplingParams(temperature=0, max_tokens=16))
    print(outs[0].outputs[0].text)
"""

from __future__ import annotations

import itertools
from typing import Any, Sequence

from tqdm.auto import tqdm

from runtime.config import EngineConfig
from runtime.engine import Engine
from runtime.outputs import RequestOutput
from runtime.sampling_params import SamplingParams
from runtime.step import LoadedModel

Prompt = str | list[int]


class LLM:
    """An engine for batch generation in this process.

    Args:
        model: model ID, local folder or servax-tiny/<name>.
        loaded_model: an already loaded LoadedModel to serve instead of calling registry.load.
        **engine_kwargs: any EngineConfig field (impl, dtype, max_model_len, ...).
    """

    def __init__(self, model: str, *, loaded_model: LoadedModel | None = None, **engine_kwargs: Any):
        self.config = EngineConfig(model=model, **engine_kwargs)
        self.engine = Engine(self.config, loaded_model)
        self._ids = itertools.count()

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    def generate(
        self,
        prompts: str | list[str] | list[int] | list[list[int]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = False,
    ) -> list[RequestOutput]:
        """Generate for every prompt; returns final outputs in prompt order.

        Raises:
            InvalidRequestError / PromptTooLongError: before anything is queued.
        """
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompt_list: list[Prompt] = [prompts]  # type: ignore[list-item]
        else:
            prompt_list = list(prompts)  # type: ignore[arg-type]
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            params_list = [sampling_params or SamplingParams()] * len(prompt_list)
        else:
            params_list = list(sampling_params)
            if len(params_list) != len(prompt_list):
                raise ValueError(f"{len(prompt_list)} prompts but {len(params_list)} sampling params")
        # Validate everything first so that a bad prompt queues nothing. Offline batches may
        # be larger than the serving queue limit.
        processed = [
            self.engine.process_inputs(f"llm-{next(self._ids)}", p, sp, enforce_queue_limit=False)
            for p, sp in zip(prompt_list, params_list)
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
