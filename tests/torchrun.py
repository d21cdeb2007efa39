"""torchrun, as `python3 -m torch.distributed.run` runs it, for the tests.

A PyTorch 2.x built without libuv (Debian 13's 2.6) has torchrun ask for a
libuv store all the same, and fail at start. There, the stores torchrun
makes ask for the classic server; everything else is torchrun's own.
"""
import runpy

import torch
import torch.distributed as dist

if int(torch.__version__.split(".")[0]) >= 2:
    class ClassicTCPStore(dist.TCPStore):
        def __init__(self, *args, **kwargs):
            kwargs["use_libuv"] = False
            super().__init__(*args, **kwargs)

    dist.TCPStore = ClassicTCPStore

runpy.run_module("torch.distributed.run", run_name="__main__", alter_sys=True)
