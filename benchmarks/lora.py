"""LoRA adapters: decode step time with several adapters in one batch against the base alone,
and the time to load an adapter.

Three engines on the ~100M benchmark Llama (float32): LoRA off; LoRA on, every request on the
base model; LoRA on, the batch spread over `--adapters` random rank-`--rank` adapters on all
seven projections. Each is timed over pure-decode engine steps (`LLMEngine.step()`, host
work included) once every request has its first token, as benchmarks/decode_floor.py does.
Load time: reading a PEFT folder into slot form (host) and writing it into a device slot.

    python benchmarks/lora.py                      # batch 32, 4 adapters, rank 16
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import bench_checkpoint, decode_step_ms, record, table  # noqa: E402

MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def write_adapter(folder: Path, config: dict, rank: int, seed: int) -> None:
    """A random PEFT LoRA adapter on all projections of a Llama config (what peft saves)."""
    import numpy as np
    from safetensors.numpy import save_file

    d, f = config["hidden_size"], config["intermediate_size"]
    hd = config.get("head_dim") or d // config["num_attention_heads"]
    q, kv = config["num_attention_heads"] * hd, config.get("num_key_value_heads", config["num_attention_heads"]) * hd
    dims = {"q_proj": (d, q), "k_proj": (d, kv), "v_proj": (d, kv), "o_proj": (q, d),
            "gate_proj": (d, f), "up_proj": (d, f), "down_proj": (f, d)}
    rng = np.random.default_rng(seed)
    tensors = {}
    for layer in range(config["num_hidden_layers"]):
        for module, (n_in, n_out) in dims.items():
            part = "mlp" if module in ("gate_proj", "up_proj", "down_proj") else "self_attn"
            key = f"base_model.model.model.layers.{layer}.{part}.{module}"
            tensors[f"{key}.lora_A.weight"] = (rng.standard_normal((rank, n_in)) * 0.01).astype(np.float32)
            tensors[f"{key}.lora_B.weight"] = (rng.standard_normal((n_out, rank)) * 0.01).astype(np.float32)
    folder.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(folder / "adapter_model.safetensors"))
    (folder / "adapter_config.json").write_text(json.dumps(
        {"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": list(MODULES), "bias": "none"}))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--adapters", type=int, default=4)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()

    import jax

    from app import LLM, LoRARequest

    path = bench_checkpoint()
    config = json.loads((path / "config.json").read_text())
    work = Path(tempfile.mkdtemp(prefix="servax-lora-bench-"))
    loras = []
    for i in range(args.adapters):
        write_adapter(work / f"a{i}", config, args.rank, seed=i)
        loras.append(LoRARequest(f"a{i}", i + 1, str(work / f"a{i}")))
    engine_args = dict(model=str(path), dtype="float32", max_model_len=512, max_num_seqs=args.batch,
                       max_num_batched_tokens=512, show_progress=False, enable_prefix_caching=False)
    plain = LLM(**engine_args)
    llm = LLM(**engine_args, enable_lora=True, max_loras=args.adapters, max_lora_rank=args.rank)
    # Load time: read + validate into slot form (host), then one device-slot write.
    t0 = time.perf_counter()
    adapter = llm.engine.lora._load(loras[0])
    read_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    llm.engine.programs.write_lora_slot(1, adapter)
    jax.block_until_ready(llm.engine.model.params["layers"])
    write_s = time.perf_counter() - t0
    llm.engine.programs.write_lora_slot(1, None)

    # Rounds alternate the three cases so that drift on the machine hits them alike; medians.
    mixed = [loras[i % args.adapters] for i in range(args.batch)]
    cases = {"LoRA off": (plain, [None] * args.batch, 0), "LoRA on, base only": (llm, [None] * args.batch, 0),
             f"LoRA on, {args.adapters} adapters mixed": (llm, mixed, args.adapters)}
    times: dict[str, list[float]] = {name: [] for name in cases}
    for r in range(args.rounds):
        for name, (engine, requests, _) in cases.items():
            times[name].append(decode_step_ms(engine, requests, args.prompt_len, args.new_tokens, f"{r}-{name}"))
    median = {name: sorted(t)[len(t) // 2] for name, t in times.items()}
    base_ms = median["LoRA off"]
    rows = [[name, args.batch, n, f"{median[name]:.1f}", " / ".join(f"{t:.0f}" for t in times[name]),
             f"{median[name] / base_ms:.2f}"] for name, (_, _, n) in cases.items()]
    body = (
        f"~100M Llama float32, rank {args.rank} on all 7 projections, prompt {args.prompt_len}, "
        f"{args.new_tokens} new tokens; decode steps only\n\n"
        + table(["engine", "batch", "adapters", "decode step ms (median)", "rounds", "vs LoRA off"], rows)
        + f"\n\nadapter load: read + validate {read_s * 1e3:.0f} ms (host), write into a device slot "
          f"{write_s * 1e3:.0f} ms"
    )
    record("LoRA adapters: decode step with adapters in the batch, load time", body)


if __name__ == "__main__":
    main()
