"""qwen3_4b: the paper-scale DAPO/GRPO recipe with a W4A4 NVFP4 sampler and TRIAGE."""

import os
import sys

sys.path.insert(0, os.path.dirname(__file__))
from _dapo import dapo_config  # noqa: E402


def get_config():
    return dapo_config("qwen3_4b")
