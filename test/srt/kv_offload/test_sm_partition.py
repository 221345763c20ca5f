"""The prefetch's SM partition (``sm_partition.SmPartition``): a stream on SMs of its own."""

import pytest
import torch
from sglang.srt.mem_cache.sparsity.kv_offload.sm_partition import SmPartition, SmPartitionError


def test_a_partition_needs_a_cuda_device():
    with pytest.raises(SmPartitionError, match="needs a CUDA device, got cpu"):
        SmPartition(8, torch.device("cpu"))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_partition_splits_the_sms_and_runs_the_copy_kernel():
    from sglang.srt.mem_cache.sparsity.kv_offload import transfer

    dev = torch.device("cuda")
    total = torch.cuda.get_device_properties(dev).multi_processor_count
    for bad in (0, total):
        with pytest.raises(SmPartitionError, match=f"ask for 1 to {total - 1}"):
            SmPartition(bad, dev)
    part = SmPartition(8, dev, with_remainder=True)
    assert 8 <= part.sms < total and part.sms + part.rest_sms == total
    # The prefetch's stream outranks the compute's; the remainder (a benchmark's compute) does not.
    highest = torch.cuda.Stream.priority_range()[1]
    assert highest < 0 and part.stream.priority == highest and part.rest_stream.priority == 0
    assert SmPartition(8, dev, priority=0).stream.priority == 0
    host = torch.randint(0, 256, (4096, 656), dtype=torch.uint8).pin_memory()
    src = torch.randperm(4096, device=dev)[:1000]
    dst = torch.zeros((1000, 656), dtype=torch.uint8, device=dev)
    part.stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(part.stream):  # a Triton kernel reading pinned host rows
        transfer.copy_rows(host, dst, src, torch.arange(1000, device=dev))
    torch.cuda.current_stream().wait_stream(part.stream)
    assert torch.equal(dst.cpu(), host[src.cpu()])
