"""The device side run in-process: what a worker answers without a thread hand-off."""

import asyncio

import numpy as np

from isthmus import errors
from isthmus.worker.host import DeviceHost, make_cpu_client


def test_all_ready_only_for_present_computed_error_free_buffers():
    async def main():
        host = DeviceHost(make_cpu_client(1))
        await host.put(1, 0, np.arange(4, dtype=np.float32))
        await host.ready([1])
        assert host.all_ready([1])
        host.fail(2, errors.ExecutionError("it broke"))
        assert not host.all_ready([1, 2])  # the slow path reports the error
        assert not host.all_ready([3])  # not (yet) here
        host.free([1])
        assert not host.all_ready([1])
        await host.close()
    asyncio.run(asyncio.wait_for(main(), 30))
