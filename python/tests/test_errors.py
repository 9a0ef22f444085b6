"""How blockkv's status codes reach Python: ValueError for what DeepSpeed raises ValueError for
(and for every bad argument or state), ResourceExhaustedError (a ValueError and a RuntimeError)
for running out, NotImplementedError for what is not implemented, RuntimeError otherwise; the
C++ message carried over."""

import blockkv
import pytest
from conftest import make_cache, make_manager, without_gpu


def test_invalid_argument_is_a_value_error():
    with pytest.raises(ValueError, match="0"):
        blockkv.BlockedAllocator(0)


def test_out_of_range_is_a_value_error_naming_the_id():
    a = blockkv.BlockedAllocator(8)
    with pytest.raises(ValueError, match="100"):
        a.free([100])
    with pytest.raises(ValueError, match="7"):
        make_cache(num_blocks=2).get_cache(7)


def test_failed_precondition_is_a_value_error():
    a = blockkv.BlockedAllocator(2)
    with pytest.raises(ValueError, match="1"):
        a.free([1])  # already free


def test_resource_exhausted_is_both_value_and_runtime_error():
    assert issubclass(blockkv.ResourceExhaustedError, ValueError)
    assert issubclass(blockkv.ResourceExhaustedError, RuntimeError)
    a = blockkv.BlockedAllocator(16)
    with pytest.raises(blockkv.ResourceExhaustedError, match="17") as failure:
        a.allocate(17)
    assert isinstance(failure.value, ValueError) and isinstance(failure.value, RuntimeError)


def test_already_exists_and_not_found_are_value_errors():
    m = make_manager()
    m.schedule([1, 2], [1, 1])
    m.post_forward([1, 2])
    with pytest.raises(ValueError, match="2"):
        m.fork(1, 2)
    with pytest.raises(ValueError, match="77"):
        m.post_forward([77])
    with pytest.raises(ValueError):
        m.fork(77, 3)


def test_unimplemented_is_not_implemented_error():
    with pytest.raises(NotImplementedError, match="num_allocation_groups"):
        make_manager(kv_configs=(blockkv.KVCacheConfig(cache_shape=(1, 1, 8),
                                                       num_allocation_groups=2),))


@without_gpu
def test_unavailable_is_a_runtime_error():
    with pytest.raises(RuntimeError) as failure:
        blockkv.CudaDevice(0)
    assert not isinstance(failure.value, ValueError)
    assert str(failure.value)


def test_scheduling_error_carries_the_result():
    m = make_manager(num_blocks=1, block_size=4)
    with pytest.raises(blockkv.SchedulingError) as failure:
        m.schedule([1], [5])
    assert failure.value.result == blockkv.SchedulingResult.KVCacheLimitExceeded
    assert blockkv.SchedulingError(blockkv.SchedulingResult.Success).args[0].startswith(
        "Batch scheduling failed with result")
