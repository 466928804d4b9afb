"""engine.json: what tk build-engine built an artifact's TensorRT engines for and from, written by the
build (exporters/trt_build.py, toolkit/pipeline/build_engine.py) and checked by the TensorRT runtime
before it loads them (runtimes/backends/trt.py). Standard library only.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from tk.models.spec import contract
from tk.models.spec.errors import UsageProblem


@dataclass(frozen=True)
class Limits:
    max_batch: int
    max_input_len: int  # longest prompt the prefill engine takes
    max_seq_len: int  # prompt + generated tokens the decode engine takes

    def check(self, max_context: int) -> None:
        if self.max_batch < 1:
            raise UsageProblem(f"--max-batch must be at least 1, got {self.max_batch}")
        if self.max_input_len < 1:
            raise UsageProblem(f"--max-input-len must be at least 1, got {self.max_input_len}")
        if self.max_seq_len < 2:
            raise UsageProblem(f"--max-seq-len must be at least 2 (a prompt token and one new one), got {self.max_seq_len}")
        if self.max_input_len >= self.max_seq_len:
            raise UsageProblem(f"--max-input-len ({self.max_input_len}) must be below --max-seq-len ({self.max_seq_len}) "
                               "so at least one token can be generated")
        if self.max_seq_len > max_context:
            raise UsageProblem(f"--max-seq-len ({self.max_seq_len}) is beyond the model's context of {max_context}")


@dataclass(frozen=True)
class Gpu:
    name: str
    compute_capability: str  # "9.0": an engine runs only on the capability it was built for


@dataclass(frozen=True, kw_only=True)
class EngineMeta:
    """engine.json. `engine_sha256` is None in files written before tk recorded the engines' hashes.
    Every engine is strongly typed (its precision is its graphs'), so the `strongly_typed` key that
    older files carry is read and dropped."""

    contract_version: int = contract.CONTRACT_VERSION
    tensorrt_version: str
    gpu: Gpu
    precision: str
    limits: Limits
    profiles: dict[str, dict[str, list[list[int]]]]  # per graph, per input: [min, opt, max] shapes
    onnx_sha256: dict[str, str]  # per graph: the graph the engine was built from
    engines: dict[str, str] = dataclasses.field(default_factory=lambda: dict(contract.ENGINE_FILES))
    engine_sha256: dict[str, str] | None = None  # per graph: the engine file, as built with this file

    def to_dict(self) -> dict:
        d = dataclasses.asdict(self)
        return d if self.engine_sha256 is not None else {k: v for k, v in d.items() if k != "engine_sha256"}

    @property
    def tensorrt_major(self) -> int:
        """A plan loads only in the TensorRT that built it; across majors even the build flags differ."""
        return tensorrt_major(self.tensorrt_version)

    @classmethod
    def from_dict(cls, d: dict) -> "EngineMeta":
        d = {k: v for k, v in d.items() if k != "strongly_typed"}  # written before every engine was strongly typed
        return cls(**{**d, "gpu": Gpu(**d["gpu"]), "limits": Limits(**d["limits"])})


def release(version: str | None) -> tuple[int, ...]:
    """A version's leading numeric parts: "10.15.1.29" -> (10, 15, 1, 29), "13.0rc1" -> (13,), None -> ()."""
    parts = []
    for part in (version or "").split("."):
        if not part.isdigit():
            break
        parts.append(int(part))
    return tuple(parts)


def tensorrt_major(version: str) -> int:
    """"10.15.1.29" -> 10."""
    return release(version)[0]
