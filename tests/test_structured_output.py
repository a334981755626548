"""Token masks in the runtime: JSON schemas, regex, choice, grammars, allowed_token_ids and
bad_words hold on the tiny random model (its logits are noise, so only the mask can make the
output valid); unconstrained neighbours are untouched; nothing compiles while serving; bad
specs are refused by field before anything is queued."""

from __future__ import annotations

import json
import re

import jax
import jsonschema
import numpy as np
import pytest

from app import LLM, SamplingParams
from runtime.engine.errors import InvalidRequestError
from runtime.engine.sampler import SamplingBatch, empty_sampling_batch, sample
from runtime.engine.sampling_params import StructuredOutputsParams
from runtime.engine.structured_output import TokenMaskCompiler, fill_token_masks, pack_token_ids, unpack_row

MODEL = "servax-tiny/llama"
# test_engine's engine shape: its programs are in the persistent compilation cache.
ENGINE = dict(max_model_len=256, max_num_seqs=16, max_num_batched_tokens=128, num_kv_blocks=512, show_progress=False)
PROMPT = "Return the data as JSON:"

SCHEMAS = [
    {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8}}, "required": ["name"]},
    {"type": "object", "properties": {"age": {"type": "integer", "minimum": 0, "maximum": 120}},
     "required": ["age"], "additionalProperties": False},
    {"type": "object", "properties": {"ok": {"type": "boolean"}, "n": {"type": "null"}}, "required": ["ok", "n"]},
    {"type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]}}, "required": ["color"]},
    {"type": "object", "properties": {"score": {"type": "number", "minimum": -1, "maximum": 1}},
     "required": ["score"]},
    {"type": "object", "properties": {"tags": {"type": "array", "items": {"type": "string", "maxLength": 4},
                                               "minItems": 2, "maxItems": 3}}, "required": ["tags"]},
    {"type": "object", "properties": {"ids": {"type": "array", "items": {"type": "integer", "minimum": 0,
                                                                          "maximum": 9}, "maxItems": 4}},
     "required": ["ids"]},
    {"type": "object", "properties": {"user": {"type": "object", "properties": {
        "id": {"type": "integer", "minimum": 1, "maximum": 999}, "name": {"type": "string", "maxLength": 6}},
        "required": ["id", "name"], "additionalProperties": False}}, "required": ["user"]},
    {"type": "object", "properties": {"a": {"type": "object", "properties": {"b": {"type": "object", "properties": {
        "c": {"enum": [1, 2, 3]}}, "required": ["c"]}}, "required": ["b"]}}, "required": ["a"]},
    {"type": "array", "items": {"type": "integer", "minimum": 10, "maximum": 20}, "minItems": 1, "maxItems": 3},
    {"type": "object", "properties": {"kind": {"const": "point"}, "x": {"type": "integer", "minimum": -5,
                                                                      "maximum": 5}}, "required": ["kind", "x"]},
    {"type": "object", "properties": {"status": {"enum": ["ok", "error"]}, "code": {"type": "integer",
                                                                                    "minimum": 100,
                                                                                    "maximum": 599}},
     "required": ["status", "code"], "additionalProperties": False},
    {"type": "object", "properties": {"value": {"anyOf": [{"type": "integer", "minimum": 0, "maximum": 9},
                                                          {"type": "boolean"}]}}, "required": ["value"]},
    {"type": "object", "properties": {"items": {"type": "array", "minItems": 1, "maxItems": 2, "items": {
        "type": "object", "properties": {"sku": {"type": "string", "maxLength": 5},
                                         "qty": {"type": "integer", "minimum": 1, "maximum": 9}},
        "required": ["sku", "qty"], "additionalProperties": False}}}, "required": ["items"]},
    {"type": "object", "properties": {"date": {"type": "string", "pattern": "^[0-9]{4}-[0-9]{2}-[0-9]{2}$"}},
     "required": ["date"]},
    {"type": "object", "properties": {"p": {"type": "number", "exclusiveMinimum": 0, "maximum": 100}},
     "required": ["p"]},
    {"type": "object", "properties": {"matrix": {"type": "array", "maxItems": 2, "items": {
        "type": "array", "maxItems": 2, "items": {"type": "integer", "minimum": 0, "maximum": 1}}}},
     "required": ["matrix"]},
    {"type": "object", "properties": {"opt": {"type": "string", "maxLength": 3},
                                      "req": {"type": "boolean"}}, "required": ["req"],
     "additionalProperties": False},
    {"type": "object", "$defs": {"pt": {"type": "object", "properties": {"x": {"enum": [0, 1]},
                                                                         "y": {"enum": [0, 1]}},
                                        "required": ["x", "y"]}},
     "properties": {"from": {"$ref": "#/$defs/pt"}, "to": {"$ref": "#/$defs/pt"}}, "required": ["from", "to"]},
    {"type": "object", "properties": {"level": {"type": "integer", "enum": [1, 2, 3]},
                                      "label": {"type": ["string", "null"], "maxLength": 5}},
     "required": ["level", "label"]},
]


@pytest.fixture(scope="module")
def llm(servax_cache) -> LLM:
    return LLM(MODEL, **ENGINE)


def constrained(kind: str, spec, seed: int = 0, **kw) -> SamplingParams:
    return SamplingParams(temperature=1.0, seed=seed, max_tokens=200, structured_outputs={kind: spec, **kw})


def assert_all_blocks_free(llm: LLM) -> None:
    s = llm.engine.stats()
    assert s.kv_blocks_used == 0 and s.num_running == 0 and s.num_waiting == 0


# ---- the mask itself ---------------------------------------------------------------------

def test_packed_rows_round_trip():
    ids = [0, 1, 31, 32, 63, 64, 500, 511]
    row = pack_token_ids(ids, 16)
    assert row.dtype == np.int32 and row.shape == (16,)
    assert unpack_row(row, 512).tolist() == ids


@pytest.mark.parametrize("greedy", [True, False])
def test_sampler_only_picks_masked_in_tokens(greedy):
    rows, vocab = 8, 100
    rng = np.random.default_rng(0)
    logits = rng.normal(size=(rows, vocab)).astype(np.float32) * 5
    sb = empty_sampling_batch(rows, 1, mask_words=4)
    allowed = [rng.choice(vocab, size=3, replace=False).tolist() for _ in range(rows - 1)]
    for r, ids in enumerate(allowed):
        sb["token_mask"][r] = pack_token_ids(ids, 4)
    sb["temperature"][:] = 0.0 if greedy else 1.0
    sb["seeds"][:] = np.arange(rows)
    out = jax.jit(sample, static_argnames=("num_logprobs", "use_penalties"))(
        logits, SamplingBatch(**sb), num_logprobs=2, use_penalties=False)
    sampled = np.asarray(out.sampled)
    for r, ids in enumerate(allowed):
        assert sampled[r] in ids
    assert sampled[-1] == np.argmax(logits[-1]) if greedy else True  # an all-ones row is free
    # Logprobs stay those of the model's raw distribution.
    raw = jax.nn.log_softmax(logits, axis=-1)
    np.testing.assert_allclose(np.asarray(out.chosen_logprob), raw[np.arange(rows), sampled], rtol=1e-5)


def test_grammar_rows_mask_ids_beyond_the_tokenizer(llm):
    tokenizer = llm.get_tokenizer()
    compiler = TokenMaskCompiler(tokenizer, vocab_size=len(tokenizer) + 100, eos_token_ids=[0])
    compiled = compiler.compile(SamplingParams(structured_outputs={"json_object": True}, allowed_token_ids=None))
    state = compiled.start()
    mask = np.full((2, compiled.num_words), -1, np.int32)
    fill_token_masks(mask, [(1, state, [])])
    allowed = unpack_row(mask[1], len(tokenizer) + 100)
    assert len(allowed) > 0 and allowed.max() < len(tokenizer)
    assert all(tokenizer.decode([t]).lstrip().startswith("{") for t in allowed)
    assert (mask[0] == -1).all()


def test_grammar_compilation_is_cached_per_spec(llm):
    compiler = llm.engine.processor.token_masks
    spec = StructuredOutputsParams(json=SCHEMAS[0])
    assert compiler.grammar(spec) is compiler.grammar(StructuredOutputsParams(json=json.dumps(SCHEMAS[0])))
    assert compiler.grammar(spec) is not compiler.grammar(StructuredOutputsParams(json=SCHEMAS[1]))


def _accepts(compiler: TokenMaskCompiler, tokenizer, text: str, **spec) -> bool:
    """Whether the grammar of `spec` takes `text` whole (token by token, then complete)."""
    matcher = compiler.grammar(StructuredOutputsParams(**spec)).deep_copy()
    ids = tokenizer.encode(text, add_special_tokens=False)
    return matcher.consume_tokens(ids) and not matcher.is_error() and matcher.is_accepting()


def test_json_whitespace_is_bounded_and_objects_closed_by_default(llm):
    tokenizer, compiler = llm.get_tokenizer(), llm.engine.processor.token_masks
    schema = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "object", "properties": {
        "c": {"type": "string"}}, "required": ["c"]}}, "required": ["a", "b"]}
    value = {"a": 1, "b": {"c": "x"}}
    for text in (json.dumps(value), json.dumps(value, separators=(",", ":")), json.dumps(value, indent=2),
                 json.dumps(value, indent=4), json.dumps(value, indent="\t")):
        assert _accepts(compiler, tokenizer, text, json=schema), text
    for text in ('{"a": 1,      "b": {"c": "x"}}', '{"a": 1, "b": {"c": "x"}' + "\n" * 3 + "}",
                 '{"a": 1, "b": {"c": "x"},\n' + " " * 17 + '"d": 2}'):
        assert not _accepts(compiler, tokenizer, text, json=schema), text
    assert not _accepts(compiler, tokenizer, json.dumps(value), json=schema, disable_any_whitespace=True)
    assert _accepts(compiler, tokenizer, '{"a":1,   "b":{"c":"x"}}', json=schema, whitespace_pattern=" *")
    # As vLLM's default backend: no property the schema does not list, unless it says so;
    # data (const, enum) is never rewritten.
    extra = {"a": 1, "b": {"c": "x", "z": 2}}
    assert not _accepts(compiler, tokenizer, json.dumps(extra), json=schema)
    open_b = json.loads(json.dumps(schema))
    open_b["properties"]["b"]["additionalProperties"] = True
    assert _accepts(compiler, tokenizer, json.dumps(extra), json=open_b)
    const = {"const": {"properties": {"x": 1}}}
    assert _accepts(compiler, tokenizer, json.dumps(const["const"]), json=const)
    assert _accepts(compiler, tokenizer, json.dumps({"k": [1]}), json_object=True)


# ---- outputs on the random model -----------------------------------------------------------

def test_twenty_json_schemas_hold_on_a_random_model(llm):
    # Objects without unlisted keys (the default; vLLM callers also send
    # disable_additional_properties) and bounded whitespace; half the schemas get compact JSON.
    params = [constrained("json", schema, seed=i, disable_any_whitespace=i % 2 == 1,
                          disable_additional_properties=True) for i, schema in enumerate(SCHEMAS)]
    outs = llm.generate([PROMPT] * len(SCHEMAS), params, use_tqdm=False)
    for schema, out in zip(SCHEMAS, outs):
        c = out.outputs[0]
        assert c.finish_reason == "stop", (schema, c.text)
        jsonschema.validate(json.loads(c.text), schema)
    assert llm.engine.stats().compilations_since_warmup == 0
    assert_all_blocks_free(llm)


def test_json_object_regex_choice_and_grammars_hold(llm):
    regexes = [r"\d{3}-\d{4}", r"[a-f0-9]{8}", r"(yes|no), [A-Z][a-z]{2,5}\.", r"[a-z]{1,6}@[a-z]{1,6}\.(com|org)"]
    choices = [["red", "green", "blue"], ["Paris", "London", "Tokyo", "New York"]]
    lark = 'start: "(" item ("," item)* ")"\nitem: /[a-z]{1,3}/ | NUMBER\nNUMBER: /[0-9]{1,2}/'
    ebnf = 'root ::= "x=" digit digit? ";"\ndigit ::= [0-9]'
    params = ([constrained("regex", r, seed=i) for i, r in enumerate(regexes)]
              + [constrained("choice", c, seed=i) for i, c in enumerate(choices)]
              # json_object: noise writes keys of unbounded length; this seed closes the object.
              + [constrained("grammar", lark), constrained("grammar", ebnf), constrained("json_object", True, seed=7)])
    outs = [o.outputs[0] for o in llm.generate([PROMPT] * len(params), params, use_tqdm=False)]
    for r, c in zip(regexes, outs):
        assert re.fullmatch(r, c.text) and c.finish_reason == "stop", (r, c.text)
    for choice, c in zip(choices, outs[len(regexes):]):
        assert c.text in choice and c.finish_reason == "stop" and c.stop_reason is None
    assert re.fullmatch(r"\(([a-z]{1,3}|[0-9]{1,2})(,([a-z]{1,3}|[0-9]{1,2}))*\)", outs[-3].text), outs[-3].text
    assert re.fullmatch(r"x=[0-9]{1,2};", outs[-2].text), outs[-2].text
    assert isinstance(json.loads(outs[-1].text), dict)


def test_greedy_and_n_children_each_follow_the_grammar(llm):
    schema = SCHEMAS[7]
    structured = {"json": schema, "disable_additional_properties": True}
    greedy = SamplingParams(temperature=0, max_tokens=200, structured_outputs=structured)
    sampled = SamplingParams(n=3, temperature=1.0, seed=5, max_tokens=200, structured_outputs=structured)
    a, b = llm.generate([PROMPT, PROMPT], [greedy, sampled], use_tqdm=False)
    for c in a.outputs + b.outputs:
        if c.finish_reason == "stop":
            jsonschema.validate(json.loads(c.text), schema)
        else:  # greedy noise may loop inside a string: still a prefix the grammar allows
            assert c.finish_reason == "length" and c.text.startswith("{")
    assert all(c.finish_reason == "stop" for c in b.outputs)


def test_free_requests_keep_their_tokens_beside_constrained_ones(llm):
    free = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    prompts = ["Hello there", "The sea is", "One two three", "A long time ago"]
    alone = [o.outputs[0].token_ids for o in llm.generate(prompts, free, use_tqdm=False)]
    mixed_prompts = [p for pair in zip(prompts, [PROMPT] * 4) for p in pair]
    mixed_params = [p for i in range(4) for p in (free, constrained("json", SCHEMAS[i], seed=i,
                                                                     disable_additional_properties=True))]
    outs = llm.generate(mixed_prompts, mixed_params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs[0::2]] == alone
    for schema, o in zip(SCHEMAS, outs[1::2]):
        jsonschema.validate(json.loads(o.outputs[0].text), schema)


def test_allowed_token_ids_and_bad_words(llm):
    allowed = [70, 71, 72, 224]
    out = llm.generate([PROMPT], SamplingParams(temperature=1.0, seed=3, max_tokens=32, ignore_eos=True,
                                                allowed_token_ids=allowed), use_tqdm=False)[0].outputs[0]
    assert len(out.token_ids) == 32 and set(out.token_ids) <= set(allowed)

    tokenizer = llm.get_tokenizer()
    free = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)
    tokens = llm.generate([PROMPT], free, use_tqdm=False)[0].outputs[0].token_ids
    # A generated token that is a whole word on its own: ban the word.
    banned = next(t for t in tokens[1:] if tokenizer.decode([t]).strip().isalpha()
                  and tokenizer.encode(tokenizer.decode([t]).strip(), add_special_tokens=False) == [t])
    word = tokenizer.decode([banned]).strip()
    again = llm.generate([PROMPT], free.clone(bad_words=[word]), use_tqdm=False)[0].outputs[0].token_ids
    assert banned not in again and again[:tokens.index(banned)] == tokens[:tokens.index(banned)]


def test_nothing_compiles_after_warmup(llm):
    llm.generate([PROMPT] * 3, [constrained("choice", ["a", "b"]), SamplingParams(temperature=0, max_tokens=4),
                                SamplingParams(temperature=0.5, seed=1, max_tokens=8, repetition_penalty=1.2,
                                               allowed_token_ids=[5, 6, 7])], use_tqdm=False)
    assert llm.engine.stats().compilations_since_warmup == 0


# ---- bad input -----------------------------------------------------------------------------

@pytest.mark.parametrize("structured, param", [
    ({"json": {"type": "object", "properties": {"a": {"type": "strung"}}}}, "structured_outputs.json"),
    ({"json": {"type": "object", "properties": {"a": {"not": {"type": "string"}}}}}, "structured_outputs.json"),
    ({"json": "{not json"}, "structured_outputs.json"),
    ({"regex": "(abc"}, "structured_outputs.regex"),
    ({"grammar": "start: undefined_rule"}, "structured_outputs.grammar"),
    ({"choice": []}, "structured_outputs.choice"),
    ({"regex": "a", "choice": ["a"]}, "structured_outputs"),
    ({"structural_tag": "{}"}, "structured_outputs.structural_tag"),
    ({"jsn": {}}, "structured_outputs.jsn"),
])
def test_bad_grammars_are_refused_by_field(llm, structured, param):
    with pytest.raises(InvalidRequestError) as err:
        llm.generate([PROMPT], SamplingParams(structured_outputs=structured), use_tqdm=False)
    assert err.value.param == param, err.value
    assert_all_blocks_free(llm)


@pytest.mark.parametrize("fields, param", [
    (dict(allowed_token_ids=[]), "allowed_token_ids"),
    (dict(allowed_token_ids=[10**6]), "allowed_token_ids"),
    (dict(bad_words=[""]), "bad_words"),
])
def test_bad_token_lists_are_refused_by_field(llm, fields, param):
    with pytest.raises(InvalidRequestError) as err:
        llm.generate([PROMPT], SamplingParams(**fields), use_tqdm=False)
    assert err.value.param == param


def test_a_refused_request_leaves_the_batch_alone(llm):
    """Validation of a whole batch happens before anything is queued: one bad spec, nothing runs."""
    good = constrained("choice", ["x", "y"])
    with pytest.raises(InvalidRequestError):
        llm.generate([PROMPT, PROMPT], [good, SamplingParams(structured_outputs={"regex": "("})], use_tqdm=False)
    assert_all_blocks_free(llm)
    assert llm.generate([PROMPT], good, use_tqdm=False)[0].outputs[0].text in ("x", "y")


@pytest.mark.slow
def test_torchax_path_follows_the_grammar(servax_cache):
    """The mask lives in the sampler, after either path's step function."""
    fallback = LLM(MODEL, model_impl="torchax", max_model_len=256, max_num_seqs=8, max_num_batched_tokens=64,
                   num_kv_blocks=128, show_progress=False)
    assert fallback.engine.model.impl == "torchax"
    params = [constrained("json", schema, seed=i, disable_additional_properties=True)
              for i, schema in enumerate(SCHEMAS[:4])]
    for schema, out in zip(SCHEMAS, fallback.generate([PROMPT] * 4, params, use_tqdm=False)):
        assert out.outputs[0].finish_reason == "stop"
        jsonschema.validate(json.loads(out.outputs[0].text), schema)
    assert fallback.engine.stats().compilations_since_warmup == 0


# ---- a real model ----------------------------------------------------------------------------

@pytest.mark.slow
def test_demo_model_extracts_the_right_fields(servax_cache):
    """SmolLM2-135M-Instruct under a schema: valid JSON with the facts of the text (free, it
    writes an invalid, rambling object for the same prompt)."""
    demo = LLM("servax-demo/smollm2-135m-instruct", max_model_len=512, max_num_seqs=4, max_num_batched_tokens=256,
               show_progress=False)
    schema = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"},
                                               "city": {"type": "string"}},
              "required": ["name", "age", "city"], "additionalProperties": False}
    messages = [{"role": "user", "content": "Extract the person's name, age and city as JSON.\n"
                                            "Text: Maria Lopez is 34 years old and lives in Madrid."}]
    out = demo.chat(messages, SamplingParams(temperature=0, max_tokens=80, structured_outputs={"json": schema}),
                    use_tqdm=False)[0].outputs[0]
    assert out.finish_reason == "stop"
    assert json.loads(out.text) == {"name": "Maria Lopez", "age": 34, "city": "Madrid"}
    assert demo.engine.stats().compilations_since_warmup == 0
