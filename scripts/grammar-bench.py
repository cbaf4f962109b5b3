"""Measures the grammar backend on the default model's tokenizer (docs/performance.md).

    python scripts/grammar-bench.py            # llguidance, through verifier_svc/grammar/
    python scripts/grammar-bench.py --xgrammar # also xgrammar, if installed (not a dependency)

Prints: tokenizer-info time, cold compile time, mask fill per token of a JSON answer,
JSON Schema features each backend compiles, the share of an answer's tokens that
`forced_tokens` covers, and the grammar's work per sequence in a k = 4 step.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Any

import torch

from specdec.models.model_files import DEFAULT_MODEL, load_tokenizer, resolve_model
from verifier_svc.grammar import GrammarBackend, apply_masks

ANSWERS: dict[str, tuple[dict[str, Any], dict[str, Any]]] = {
    "extraction": (
        {"type": "object", "properties": {
            "name": {"type": "string"}, "age": {"type": "integer", "minimum": 0, "maximum": 150},
            "role": {"enum": ["admin", "user", "guest"]},
            "tags": {"type": "array", "items": {"type": "string"}},
            "address": {"type": "object", "properties": {
                "city": {"type": "string"}, "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
                "required": ["city", "zip"], "additionalProperties": False}},
         "required": ["name", "age", "role", "tags", "address"], "additionalProperties": False},
        {"name": "Ada Lovelace", "age": 36, "role": "admin", "tags": ["math", "poetry"],
         "address": {"city": "London", "zip": "12345"}}),
    "invoice": (
        {"type": "object", "properties": {
            "invoice_id": {"type": "string"}, "currency": {"enum": ["EUR", "USD", "GBP"]},
            "paid": {"type": "boolean"},
            "items": {"type": "array", "items": {"type": "object", "properties": {
                "description": {"type": "string"}, "quantity": {"type": "integer", "minimum": 1},
                "unit_price": {"type": "number"}},
                "required": ["description", "quantity", "unit_price"], "additionalProperties": False}},
            "total": {"type": "number"}},
         "required": ["invoice_id", "currency", "paid", "items", "total"], "additionalProperties": False},
        {"invoice_id": "INV-2041", "currency": "EUR", "paid": False,
         "items": [{"description": "Widget", "quantity": 3, "unit_price": 4.5},
                   {"description": "Gadget", "quantity": 1, "unit_price": 12.0}], "total": 25.5}),
    "tool_args": (
        {"type": "object", "properties": {
            "city": {"type": "string"}, "unit": {"enum": ["celsius", "fahrenheit"]},
            "days": {"type": "integer", "minimum": 1, "maximum": 7}},
         "required": ["city", "unit", "days"], "additionalProperties": False},
        {"city": "Paris", "unit": "celsius", "days": 3}),
}
FEATURES: dict[str, dict[str, Any]] = {
    "nested": {"type": "object", "properties": {"a": {"type": "object", "properties": {"b": {"type": "integer"}}}}},
    "array bounds": {"type": "array", "items": {"type": "integer"}, "minItems": 1, "maxItems": 3},
    "enum": {"enum": ["x", "y", 3]},
    "const": {"const": "x"},
    "integer bounds": {"type": "integer", "minimum": -5, "maximum": 500},
    "pattern": {"type": "string", "pattern": "^[a-z]{2}-[0-9]+$"},
    "$ref": {"$defs": {"p": {"type": "object", "properties": {"x": {"type": "number"}}}},
             "type": "object", "properties": {"p": {"$ref": "#/$defs/p"}}},
    "recursive $ref": {"$defs": {"n": {"type": "object", "properties": {
        "c": {"type": "array", "items": {"$ref": "#/$defs/n"}}}}}, "$ref": "#/$defs/n"},
    "anyOf": {"anyOf": [{"type": "string"}, {"type": "integer"}]},
    "oneOf": {"oneOf": [{"type": "string"}, {"type": "integer"}]},
    "allOf": {"allOf": [{"type": "object", "properties": {"a": {"type": "integer"}}}, {"required": ["a"]}]},
    "additionalProperties false": {"type": "object", "properties": {"a": {"type": "integer"}},
                                   "additionalProperties": False},
    "additionalProperties schema": {"type": "object", "additionalProperties": {"type": "integer"}},
    "format date/email": {"type": "array", "prefixItems": [{"type": "string", "format": "date"},
                                                           {"type": "string", "format": "email"}]},
    "min/maxLength": {"type": "string", "minLength": 2, "maxLength": 4},
    "patternProperties": {"type": "object", "patternProperties": {"^x": {"type": "integer"}}},
    "minProperties": {"type": "object", "minProperties": 1},
    "uniqueItems": {"type": "array", "items": {"type": "integer"}, "uniqueItems": True},
    "if/then": {"type": "object", "if": {"properties": {"a": {"const": 1}}}, "then": {"required": ["b"]}},
}


def median_us(values: list[float]) -> float:
    return round(statistics.median(values) * 1e6, 1)


def bench_llguidance(tokenizer: Any, vocab_size: int) -> None:
    started = time.perf_counter()
    backend = GrammarBackend(tokenizer, vocab_size)
    print(f"llguidance: tokenizer info {time.perf_counter() - started:.2f} s")
    unsupported = []
    for name, schema in FEATURES.items():
        try:
            backend.compile("json_schema", json.dumps(schema))
        except Exception as error:
            unsupported.append(f"{name} ({str(error)[:60]})")
    print("  unsupported:", unsupported or "none")
    for name, (schema, answer) in ANSWERS.items():
        started = time.perf_counter()
        state = backend.new_state(backend.compile("json_schema", json.dumps(schema)))
        state.fill_masks([])
        compile_ms = (time.perf_counter() - started) * 1e3
        ids = tokenizer.encode(json.dumps(answer), add_special_tokens=False)
        forced = position = 0
        while position < len(ids):  # take each forced run where it matches the answer
            run = state.forced_tokens(64)
            matched = 0
            while matched < len(run) and position + matched < len(ids) and run[matched] == ids[position + matched]:
                matched += 1
            forced += matched
            step = max(matched, 1)
            state.accept_tokens(ids[position:position + step])
            position += step
        state.rollback(state.num_accepted)
        one, steps = [], []
        logits = torch.randn(5, vocab_size)
        for _ in range(10):
            for index, token in enumerate(ids):
                started = time.perf_counter()
                state.fill_masks([])
                one.append(time.perf_counter() - started)
                draft = ids[index:index + 4]
                rows = logits[: len(draft) + 1].clone()
                started = time.perf_counter()
                valid = state.valid_prefix_len(draft)
                apply_masks(rows, state.fill_masks(draft[:valid]))
                state.forced_tokens(4)
                steps.append(time.perf_counter() - started)
                state.accept(token)
            state.rollback(state.num_accepted)
        print(f"  {name}: {len(ids)} tokens, compile {compile_ms:.1f} ms, forced {forced}/{len(ids)} "
              f"({forced / len(ids):.0%}), one mask {median_us(one)} us, "
              f"k=4 step (cut, 5 masks, mask logits, forced) {median_us(steps)} us")


def bench_xgrammar(tokenizer: Any, vocab_size: int) -> None:
    import xgrammar as xgr

    started = time.perf_counter()
    info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size)
    print(f"xgrammar: tokenizer info {time.perf_counter() - started:.2f} s")
    compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)

    def compile_schema(schema: dict[str, Any]) -> Any:
        return compiler.compile_json_schema(json.dumps(schema), any_whitespace=False,
                                            separators=(", ", ": "))

    unsupported = []
    for name, schema in FEATURES.items():
        try:
            compile_schema(schema)
        except Exception as error:
            unsupported.append(f"{name} ({str(error)[:60]})")
    print("  unsupported:", unsupported or "none")
    bitmask = xgr.allocate_token_bitmask(1, vocab_size)
    for name, (schema, answer) in ANSWERS.items():
        started = time.perf_counter()
        matcher = xgr.GrammarMatcher(compile_schema(schema))
        matcher.fill_next_token_bitmask(bitmask, 0)
        compile_ms = (time.perf_counter() - started) * 1e3
        ids = tokenizer.encode(json.dumps(answer), add_special_tokens=False)
        one = []
        for _ in range(10):
            matcher = xgr.GrammarMatcher(compile_schema(schema))
            for token in ids:
                started = time.perf_counter()
                matcher.fill_next_token_bitmask(bitmask, 0)
                one.append(time.perf_counter() - started)
                matcher.accept_token(token)
        print(f"  {name}: compile {compile_ms:.1f} ms, one mask {median_us(one)} us")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--xgrammar", action="store_true", help="also measure xgrammar")
    args = parser.parse_args()
    torch.set_num_threads(1)
    tokenizer = load_tokenizer(resolve_model(DEFAULT_MODEL))
    bench_llguidance(tokenizer, len(tokenizer))
    if args.xgrammar:
        bench_xgrammar(tokenizer, len(tokenizer))


if __name__ == "__main__":
    main()
