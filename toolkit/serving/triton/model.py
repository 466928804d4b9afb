"""The model.py that `tk triton` copies into a Triton model repository (`<name>/1/model.py`).

Triton's python backend runs it in its stub process, which ignores PYTHONPATH: the repository's
config.pbtxt lists, in its `tk_sys_path` parameter, where tk and its packages were installed
when the repository was written (paths that do not exist where Triton runs, as in NVIDIA's
container with tk pip-installed, are skipped). All the work is toolkit/serving/triton/backend.py's.
"""

import json
import os
import site
import sys


class TritonPythonModel:
    def initialize(self, args):
        config = json.loads(args["model_config"])
        params = {k: v["string_value"] for k, v in config.get("parameters", {}).items()}
        for path in reversed(json.loads(params.get("tk_sys_path", "[]"))):
            if os.path.isdir(path) and path not in sys.path:
                sys.path.insert(0, path)
                site.addsitedir(path)  # its .pth files: an editable tk is found through one
        import triton_python_backend_utils as pb_utils

        from tk.toolkit.serving.triton.backend import TkModel

        model_dir = os.path.join(args["model_repository"], args["model_version"])
        self.model = TkModel(pb_utils, params, model_dir, args["model_name"])

    def execute(self, requests):
        return self.model.execute(requests)

    def finalize(self):
        self.model.finalize()
