"""A fake `tensorrt` module for the engine build (exporters/trt_build.py), in the two flavours tk
supports: 10.x, whose BuilderFlag still has FP16/BF16/INT8, and 11.x, whose BuilderFlag has none of
them (like the real 11.4 bindings: an attribute tk must not touch raises AttributeError here too).
It records what the build asked for and fails where TensorRT does: a timing cache from another
version is refused, and optionally an Attention layer without `TRT_decomposable=1` fails to build."""

from __future__ import annotations

import enum
import types
from pathlib import Path

import onnx

ATTENTION_ERROR = ("[graphShapeAnalyzer.cpp] Error Code 10: Could not find any implementation for node "
                   "{name} (IAttentionLayer, not decomposable)")


class Severity(enum.IntEnum):
    INTERNAL_ERROR = 0
    ERROR = 1
    WARNING = 2
    INFO = 3
    VERBOSE = 4


class ILogger:
    Severity = Severity

    def __init__(self):
        pass


def fake_tensorrt(version: str, *, attention: str = "fused", parser_error: str | None = None):
    """`attention`: "fused" (every Attention builds), "needs-decomposable" (builds only with
    TRT_decomposable=1, like fp32 or unusual head dims), "fails" (never builds). `parser_error`: the
    parser rejects every graph with this message. `trt.record` holds what each build asked for."""
    major = int(version.split(".")[0])
    record = types.SimpleNamespace(builds=[], timing_blobs=[])
    cache_tag = f"timing:{version}:".encode()
    flags = {"TF32": 7, "REFIT": 1, **({"FP16": 0, "BF16": 11, "INT8": 2} if major < 11 else {})}

    class TimingCache:
        def __init__(self, data: bytes):
            self.data = data

        def serialize(self) -> bytes:
            return self.data + b"+"  # what the build added

    class Config:
        def __init__(self):
            self.set_flags, self.cleared, self.pool, self.profiles, self.cache = [], [], {}, [], None

        def set_memory_pool_limit(self, pool, size):
            self.pool[pool] = size

        def set_flag(self, flag):
            self.set_flags.append(flag)

        def clear_flag(self, flag):
            self.cleared.append(flag)

        def add_optimization_profile(self, profile):
            self.profiles.append(profile)

        def create_timing_cache(self, blob):
            record.timing_blobs.append(bytes(blob))
            return TimingCache(bytes(blob) or cache_tag)

        def set_timing_cache(self, cache, ignore_mismatch):
            self.cache = cache if cache.data.startswith(cache_tag) else None
            return self.cache is not None  # another TensorRT's cache: refused, as the real one does

        def get_timing_cache(self):
            return self.cache

    class Network:
        def __init__(self, flags):
            self.flags, self.model, self.path, self.from_bytes = flags, None, None, False

        def decomposable(self) -> bool:
            return all(any(a.name == "TRT_decomposable" and a.i == 1 for a in n.attribute)
                       for n in self.model.graph.node if n.op_type == "Attention")

    class Error:
        def __init__(self, desc):
            self._desc = desc

        def desc(self):
            return self._desc

        def node_name(self):
            return "node_scaled_dot_product_attention" if "ttention" in self._desc else ""

        def node_operator(self):
            return "Attention" if "ttention" in self._desc else ""

    class OnnxParser:
        def __init__(self, network, logger):
            assert isinstance(logger, ILogger)
            self.network, self.num_errors = network, 0

        def _parse(self, model, path):
            if parser_error:
                self.num_errors = 1
                return False
            for tensor in model.graph.initializer:  # external weights resolve beside the path
                for entry in tensor.external_data:
                    if entry.key == "location":
                        assert (Path(path).parent / entry.value).is_file(), entry.value
            self.network.model, self.network.path = model, path
            return True

        def parse_from_file(self, path):
            return self._parse(onnx.load(path, load_external_data=False), path)

        def parse(self, model, path=None):
            self.network.from_bytes = True
            return self._parse(onnx.load_from_string(bytes(model)), path)

        def get_error(self, i):
            return Error(parser_error)

    class Profile:
        def __init__(self):
            self.shapes = {}

        def set_shape(self, name, lo, opt, hi):
            self.shapes[name] = (lo, opt, hi)

    class Builder:
        def __init__(self, logger):
            assert isinstance(logger, ILogger)
            self.logger = logger

        def create_network(self, flags):
            return Network(flags)

        def create_builder_config(self):
            return Config()

        def create_optimization_profile(self):
            return Profile()

        def build_serialized_network(self, network, config):
            record.builds.append((network, config))
            assert config.cache is not None, "the build ran without a timing cache"
            if attention == "fails" or attention == "needs-decomposable" and not network.decomposable():
                name = next(n.name for n in network.model.graph.node if n.op_type == "Attention")
                self.logger.log(Severity.ERROR, ATTENTION_ERROR.format(name=name))
                return None
            config.cache = TimingCache(config.cache.serialize())
            return f"{Path(network.path).stem} engine".encode()

    return types.SimpleNamespace(
        __version__=version, record=record, ILogger=ILogger, Builder=Builder, OnnxParser=OnnxParser,
        NetworkDefinitionCreationFlag=types.SimpleNamespace(STRONGLY_TYPED=1),
        BuilderFlag=types.SimpleNamespace(**flags), MemoryPoolType=types.SimpleNamespace(WORKSPACE=0))
