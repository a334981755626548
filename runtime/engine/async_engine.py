"""AsyncLLMEngine: the engine loop on its own thread, results streamed into asyncio.

    engine = AsyncLLMEngine(EngineConfig(model="servax-tiny/llama", max_model_len=512), loaded_model)
    async for out in engine.generate("Hello", SamplingParams(max_tokens=32), request_id="r1"):
        print(out.outputs[0].delta_text, end="")

The loop thread owns the synchronous Engine: it drains a command queue (add / abort),
runs `Engine.step()` while there is work, and hands each step's RequestOutputs to the
asyncio loop of their consumers with one `loop.call_soon_threadsafe` per loop. The event loop never
runs model code. If the consumer of `generate()` stops (cancelled, generator closed,
client gone) the request is aborted and its blocks freed.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import logging
import threading
from typing import Any, AsyncIterator, Callable

from runtime.engine.block_pool import BlockHashEvents
from runtime.engine.config import EngineConfig
from runtime.engine.core import Engine, ProcessedRequest
from runtime.engine.errors import EngineDeadError, InvalidRequestError
from runtime.engine.outputs import RequestOutput
from runtime.engine.input_processor import PromptType
from runtime.engine.introspection import EngineStats
from runtime.engine.sampling_params import SamplingParams
from runtime.ops.step import LoadedModel

logger = logging.getLogger("servax.engine")


def merge_snapshots(older: RequestOutput, newer: RequestOutput) -> RequestOutput:
    """`newer`, with the deltas of `older` prepended: one snapshot as if both came at once.

    Snapshots are cumulative (text, token_ids, logprobs); only the per-snapshot deltas
    need joining.
    """
    before = {c.index: c for c in older.outputs}
    outputs = []
    for c in newer.outputs:
        o = before.get(c.index)
        if o is not None and (o.delta_token_ids or o.delta_text):
            logprobs = None
            if o.delta_logprobs is not None or c.delta_logprobs is not None:
                logprobs = list(o.delta_logprobs or []) + list(c.delta_logprobs or [])
            c = dataclasses.replace(
                c, delta_text=o.delta_text + c.delta_text,
                delta_token_ids=list(o.delta_token_ids) + list(c.delta_token_ids), delta_logprobs=logprobs,
            )
        outputs.append(c)
    return dataclasses.replace(newer, outputs=outputs)


def _deliver(items: list) -> None:
    for queue, item in items:
        queue.put_nowait(item)


class _Stream:
    __slots__ = ("loop", "queue")

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self.loop = loop
        self.queue: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()

    def put(self, item: RequestOutput | BaseException) -> None:
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, item)
        except RuntimeError:  # the consumer's loop is closed; nobody is listening
            pass


class AsyncLLMEngine:
    """Warms up an engine for a loaded model and serves requests from a background thread.

    Args:
        config: engine settings.
        model: the loaded model (registry.load).

    Raises (from the constructor): whatever Engine raises (ValueError).
    """

    def __init__(self, config: EngineConfig, model: LoadedModel):
        self.config = config
        self.engine = Engine(config, model)
        self.engine.before_schedule = self._drain_adds
        self._commands: collections.deque[tuple[str, Any]] = collections.deque()
        self._wake = threading.Event()
        self._streams: dict[str, _Stream] = {}
        self._streams_lock = threading.Lock()
        self._engine_lock = threading.Lock()  # held by the loop while it touches the engine
        self._num_pending = 0  # adds posted but not yet drained (counts toward max_queue_size)
        self._pending_lock = threading.Lock()
        self._stop = threading.Event()
        self._error: BaseException | None = None
        self._latest_stats = self.engine.stats()  # refreshed by the loop after every step
        # Called once with the error when the engine is found dead, after every stream has failed.
        self.on_death: Callable[[BaseException], None] | None = None
        self._thread = threading.Thread(target=self._run, name="servax-engine-loop", daemon=True)
        self._thread.start()

    # -- public API ----------------------------------------------------------------------
    @property
    def tokenizer(self) -> Any:
        return self.engine.tokenizer

    @property
    def processor(self):
        """The engine's InputProcessor (chat templates, sampling params, validation); thread-safe to use."""
        return self.engine.processor

    @property
    def model_config(self) -> dict[str, Any]:
        return self.engine.model_config

    def stats(self, timeout: float | None = None) -> EngineStats:
        """The engine's EngineStats, taken between steps.

        Raises:
            TimeoutError: `timeout` seconds passed inside one step (a stuck step must not
                hold up a health check or a metrics scrape).
        """
        if not self._engine_lock.acquire(timeout=-1 if timeout is None else timeout):
            raise TimeoutError(f"the engine has been inside one step for more than {timeout} s")
        try:
            return self.engine.stats()
        finally:
            self._engine_lock.release()

    def latest_stats(self) -> EngineStats:
        """The EngineStats as of the end of the loop's last step, without waiting for the one
        under way (what gauges read on an event loop: waiting there would stall every stream
        of the process for up to a step)."""
        return self._latest_stats

    def block_hash_events(self, since: int = -1) -> BlockHashEvents:
        """Engine.block_hash_events: prefix-cache keys cached / evicted since a cursor, without
        waiting for the step under way."""
        return self.engine.block_hash_events(since)

    def enable_kv_transfer(self) -> Any:
        """Engine.enable_kv_transfer (compiles the block copies; waits for the step under way)."""
        with self._engine_lock:
            return self.engine.enable_kv_transfer()

    def take_kv(self, request_id: str) -> Any:
        """The KVTransfer a finished ExportKV request left (arrays on the host), or None. Any thread."""
        mover = self.engine.kv_transfer
        return None if mover is None else mover.take(request_id)

    # -- LoRA adapters (any thread; they wait for the loop's current step) ---------------
    def add_lora(self, lora_request: Any) -> bool:
        """Read, validate and register an adapter (Engine.add_lora); raises InvalidRequestError."""
        with self._engine_lock:
            return self.engine.add_lora(lora_request)

    def remove_lora(self, lora_int_id: int) -> bool:
        """Forget an adapter (Engine.remove_lora); raises InvalidRequestError while it is in use."""
        with self._engine_lock:
            return self.engine.remove_lora(lora_int_id)

    def list_loras(self) -> list[Any]:
        with self._engine_lock:
            return self.engine.list_loras()

    def check_health(self) -> None:
        """Raises EngineDeadError if the loop thread has stopped, or a worker process of a
        multi-process engine has failed or hangs (then open streams end with that error now,
        instead of waiting on a step that cannot finish)."""
        if self._error is not None:
            raise EngineDeadError(f"the engine loop died: {self._error!r}") from self._error
        if self._stop.is_set() or not self._thread.is_alive():
            raise EngineDeadError("the engine has been shut down")
        try:
            self.engine.check_health()  # no engine lock: the loop may be stuck holding it
        except EngineDeadError as e:
            self._die(e, e)
            raise

    async def generate(
        self, prompt: PromptType, sampling_params: SamplingParams | dict[str, Any] | None, request_id: str,
        lora_request: Any = None, kv_transfer: Any = None,
    ) -> AsyncIterator[RequestOutput]:
        """Stream RequestOutput snapshots of one request; the last has finished=True.

        lora_request: a runtime.engine.lora_request.LoRARequest to generate with (needs enable_lora).
        kv_transfer: P/D (runtime/engine/kv_transfer.py, needs enable_kv_transfer): ExportKV to
            export the prompt's blocks when it finishes (take them with `take_kv`), or a
            KVTransfer whose blocks the request starts from.

        Raises (before the first output): InvalidRequestError, PromptTooLongError,
        EngineOverloadedError, EngineDeadError.
        """
        self.check_health()
        processed = self.engine.process_inputs(request_id, prompt, sampling_params, num_pending=self._num_pending,
                                               lora_request=lora_request)
        processed.kv_transfer = kv_transfer
        stream = _Stream(asyncio.get_running_loop())
        with self._streams_lock:
            if request_id in self._streams:
                raise InvalidRequestError(f"request id {request_id!r} is already in use", param="request_id")
            self._streams[request_id] = stream
        self._post("add", processed)
        finished = False
        held: BaseException | None = None
        try:
            while True:
                item = held if held is not None else await stream.queue.get()
                held = None
                if isinstance(item, BaseException):
                    finished = True
                    raise item
                # A consumer that fell behind gets one snapshot with the deltas it missed
                # merged in, not a backlog of one message per token.
                while not item.finished and not stream.queue.empty():
                    newer = stream.queue.get_nowait()
                    if isinstance(newer, BaseException):
                        held = newer
                        break
                    item = merge_snapshots(item, newer)
                finished = item.finished
                yield item
                if finished:
                    return
        finally:
            with self._streams_lock:
                self._streams.pop(request_id, None)
            if not finished:
                self._post("abort", request_id)

    async def abort(self, request_id: str) -> None:
        """Stop a request and free its blocks; its stream ends with finish_reason 'abort'."""
        self._post("abort", request_id)

    def shutdown(self) -> None:
        """Stop the loop thread; open streams end with EngineDeadError."""
        self._stop.set()
        self._wake.set()
        if self._thread.is_alive() and threading.current_thread() is not self._thread:
            self._thread.join(timeout=30)
        self._fail_streams(EngineDeadError("the engine has been shut down"))
        self.engine.shutdown()

    # -- the loop thread -----------------------------------------------------------------
    def _post(self, kind: str, payload: Any) -> None:
        if kind == "add":
            with self._pending_lock:
                self._num_pending += 1
        self._commands.append((kind, payload))
        self._wake.set()

    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                with self._engine_lock:
                    self._drain_commands()
                    busy = self.engine.has_unfinished_requests()
                    outputs = self.engine.step() if busy else []
                    self._latest_stats = self.engine.stats()  # before the streams hear of this step
                    self._dispatch(outputs)
                if not busy:
                    self._wake.wait(timeout=1.0)
                    self._wake.clear()
        except BaseException as e:  # noqa: BLE001 - the loop must report any death
            logger.exception("servax engine loop died")
            self._die(e, EngineDeadError(f"the engine loop died: {e!r}"))

    def _die(self, error: BaseException, streams_error: BaseException) -> None:
        """The engine is dead (its loop raised, or a worker failed or hangs): record why, end
        every open stream with `streams_error`, and call on_death, once."""
        with self._streams_lock:
            first, self._error = self._error is None, self._error or error
        self._fail_streams(streams_error)
        if first and self.on_death is not None:
            self.on_death(error)

    def _drain_adds(self) -> None:
        """Add the requests posted so far, stopping at the first other command (an abort waits
        for `_drain_commands`, after the step's outputs are out). Engine.step() calls this
        just before it schedules the next step: a request that arrived during a step joins
        the very next one, one step sooner than the loop's own drain would add it."""
        while self._commands and self._commands[0][0] == "add":
            _, payload = self._commands.popleft()
            with self._pending_lock:
                self._num_pending -= 1
            self._add(payload)

    def _drain_commands(self) -> None:
        while self._commands:
            kind, payload = self._commands.popleft()
            if kind == "add":
                with self._pending_lock:
                    self._num_pending -= 1
                self._add(payload)
            elif kind == "abort":
                self._dispatch(self.engine.abort_request(payload))

    def _add(self, req: ProcessedRequest) -> None:
        with self._streams_lock:
            stream = self._streams.get(req.request_id)
        if stream is None:
            return  # the consumer went away before the request reached the loop
        try:
            self.engine.add_processed(req)
        except InvalidRequestError as e:
            stream.put(e)

    def _dispatch(self, outputs: list[RequestOutput]) -> None:
        """Hand a step's outputs to their streams: one wake-up of each consumer loop per step,
        not one per request (a step of 32 sequences wrote 32 times to the loop's wake pipe)."""
        by_loop: dict[asyncio.AbstractEventLoop, list] = {}
        with self._streams_lock:
            for out in outputs:
                stream = self._streams.get(out.request_id)
                if stream is not None:
                    by_loop.setdefault(stream.loop, []).append((stream.queue, out))
        for loop, items in by_loop.items():
            try:
                loop.call_soon_threadsafe(_deliver, items)
            except RuntimeError:  # that loop is closed; nobody is listening there
                pass

    def _fail_streams(self, error: BaseException) -> None:
        with self._streams_lock:
            streams = list(self._streams.values())
        for stream in streams:
            stream.put(error)
