# SPDX-License-Identifier: Apache-2.0
# Installs the build tree into a scratch prefix and imports the blockkv package from there, with
# nothing of the build tree on the path. Inputs: BUILD_DIR, WORK_DIR, SITE_DIR (relative to the
# prefix), PYTHON, PRELOAD (sanitizer runtimes for a sanitized build, else empty).
file(REMOVE_RECURSE ${WORK_DIR})
execute_process(COMMAND ${CMAKE_COMMAND} --install ${BUILD_DIR} --prefix ${WORK_DIR}
                OUTPUT_QUIET RESULT_VARIABLE rc)
if(NOT rc EQUAL 0)
  message(FATAL_ERROR "cmake --install ${BUILD_DIR} --prefix ${WORK_DIR} failed (${rc})")
endif()
set(site ${WORK_DIR}/${SITE_DIR})
set(env PYTHONPATH=${site} PYTHONDONTWRITEBYTECODE=1)
if(PRELOAD)
  list(APPEND env LD_PRELOAD=${PRELOAD} ASAN_OPTIONS=detect_leaks=0)
endif()
execute_process(
  COMMAND ${CMAKE_COMMAND} -E env ${env} ${PYTHON} -c "import blockkv, sys; \
assert blockkv.__file__.startswith(sys.argv[1]), blockkv.__file__; \
c = blockkv.BlockedKVCache(blockkv.KVCacheConfig(block_size=4, cache_shape=(1, 1, 8)), \
blockkv.MemoryConfig(mode='allocate', size=2), device='cpu'); \
assert list(c.reserve(2)) == [0, 1]; \
import torch, blockkv.deepspeed as ds; \
assert ds.__file__.startswith(sys.argv[1]), ds.__file__; \
cfg = ds.DSStateManagerConfig(memory_config=ds.MemoryConfig(mode='allocate', size=2)); \
m = ds.DSStateManager(cfg, (ds.KVCacheConfig(block_size=4, cache_shape=(1, 1, 8)),), device='cpu'); \
s = m.get_or_create_sequence(1); s.extend_kv_cache(m.allocate_blocks(1)); s.pre_forward(3); \
b = ds.RaggedBatchWrapper(cfg); b.insert_sequence(s, torch.tensor([1, 2, 3])); b.finalize(); \
assert b.input_ids().tolist() == [1, 2, 3]; \
print('imported', blockkv.__file__, 'and', ds.__file__)" ${site}
  RESULT_VARIABLE rc)
if(NOT rc EQUAL 0)
  message(FATAL_ERROR "import blockkv from ${site} failed (${rc})")
endif()
