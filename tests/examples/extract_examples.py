#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""Extracts every C++ example from blockkv's public headers and docs into one source file, so
that building it checks that each example compiles (the `doc_examples` test).

Where examples are:
- A public header's example is a run of comment lines indented three spaces (`//   code`) that
  follows an empty `//` line in the header's opening comment and holds code (a line ending in
  `;`, `{` or `}`). Other indented runs (formulas, tables) are not examples.
- A doc's examples are its ```cpp blocks (README.md, docs/*.md).

Examples are what a reader copies, so they stay short; what they use without declaring it comes
from a setup that the reader does not see:
- for a doc, an HTML comment right before the block:
      <!-- example setup
      std::vector<blockkv::SeqId> uids;
      -->
- for a header, HEADER_SETUP below.
A setup line `// requires: mpi cuda nccl` compiles the example only where blockkv was built with
those. A line that starts with `...` stands for the engine's own code and is left out. A block
that cannot compile at all (a shell session shown as C++, say) is marked, sparingly, with
      <!-- example: not compiled (why) -->
right before it.

Each example becomes a function returning Status in a namespace of its own, with `using namespace
blockkv;` (an example that is a whole program, with `main`, stays at global scope), under a #line
directive naming its file and line, so that a compiler error points at the doc or header itself.

Usage: extract_examples.py SOURCE_DIR OUTPUT.cc
"""

import pathlib
import re
import sys

# Declarations the headers' examples use without showing them.
HEADER_SETUP = {
    "block_allocator.h": "",
    "block_pool.h": """
        auto cache_ = BlockedKVCache::Create({KVCacheConfig{.block_size = 16, .cache_shape = {2, 8, 128}}},
                                             {.mode = AllocationMode::kAllocate, .size = 64},
                                             CpuDevice());
        BlockedKVCache& cache = **cache_;
    """,
    "cuda_device.h": """
        // requires: cuda
        void* dst = nullptr;
        const void* src = nullptr;
        size_t bytes = 0;
    """,
    "device.h": "",
    "kernels.h": """
        std::unique_ptr<BlockedKVCache> cache;
        CsrPageTable csr_table{};
        StateManager* manager = nullptr;
        RaggedBatch* batch = nullptr;
        int64_t l = 0;
        TensorView q{}, k{}, v{}, out{};
    """,
    "kv_cache.h": "",
    "transfer.h": """
        KVCacheConfig llama;
        std::shared_ptr<Device> device = CpuDevice();
        StateManager* decode = nullptr;
    """,
    "kv_events.h": """
        KVCacheConfig llama;
    """,
    "log.h": """
        static auto MyLogger = [](std::string_view) {};
    """,
    "mpi_communicator.h": """
        // requires: mpi cuda
        int argc = 0;
        char** argv = nullptr;
        MPI_Comm tp_group_comm = MPI_COMM_WORLD;
        std::vector<KVCacheConfig> configs;
        MemoryConfig memory;
        int local_rank = 0;
    """,
    "nccl_communicator.h": """
        // requires: nccl
        ncclComm_t engine_comm = nullptr;
        cudaStream_t stream = nullptr;
        std::vector<KVCacheConfig> configs;
        MemoryConfig memory;
        int local_rank = 0;
    """,
    "offload.h": """
        std::unique_ptr<BlockedKVCache> cache;
        std::vector<BlockId> table;
    """,
    "page_table.h": """
        std::unique_ptr<BlockedKVCache> cache;
        int64_t layer = 0;
        TensorView q{}, k{}, v{}, out{};
    """,
    "prefix_cache.h": """
        KVCacheConfig llama;
        SeqId uid = 0;
        std::vector<TokenId> prompt;
        struct { void Apply(const CacheEvent&) {} } router;
    """,
    "ragged_batch.h": """
        StateManager& manager = *static_cast<StateManager*>(nullptr);
        std::vector<SeqId> uids;
        std::vector<int64_t> lengths;
        std::vector<TokenId> tokens;
        std::vector<std::vector<TokenId>> tokens_of;
    """,
    "sequence.h": """
        StateManager* mgr = nullptr;
        SeqId uid = 0;
    """,
    "state_manager.h": """
        KVCacheConfig llama;
        std::vector<SeqId> uids;
        std::vector<int64_t> lengths;
        SeqId uid = 0;
    """,
    "status.h": """
        BlockedAllocator allocator = *BlockedAllocator::Create(8);
        auto Use = [](const std::vector<BlockId>&) {};
    """,
    "tensor.h": """
        BlockedKVCache& cache = *static_cast<BlockedKVCache*>(nullptr);
    """,
}

GUARDS = {"cuda": "BLOCKKV_HAVE_CUDA", "mpi": "BLOCKKV_HAVE_MPI", "nccl": "BLOCKKV_HAVE_NCCL"}
# Headers an example with these requirements needs beyond blockkv.h.
REQUIRED_INCLUDES = {
    "cuda": ["blockkv/cuda_device.h", "cuda_runtime.h"],
    "mpi": ["blockkv/mpi_communicator.h", "mpi.h"],
    "nccl": ["blockkv/nccl_communicator.h", "nccl.h", "cuda_runtime.h"],
}


class Example:
    def __init__(self, path, line, code, setup):
        self.path = path  # relative to the source dir
        self.line = line  # 1-based line of the example's first code line
        self.code = code  # list of lines
        self.setup = setup  # list of lines
        self.requires = set()
        for s in setup:
            m = re.match(r"\s*// requires:(.*)", s)
            if m:
                self.requires.update(m.group(1).split())


def header_examples(path, rel):
    lines = path.read_text().splitlines()
    examples = []
    i = 0
    # The opening comment: lines starting with // before the first other line.
    while i < len(lines) and lines[i].startswith("//"):
        if lines[i].startswith("//   ") and i > 0 and lines[i - 1].rstrip() == "//":
            start = i
            code = []
            while i < len(lines) and lines[i].startswith("//   "):
                code.append(lines[i][5:])
                i += 1
            # A run with no line of code (no ';', '{' or '}' before a comment) is a table.
            if not any(re.sub(r"//.*", "", c).rstrip().endswith((";", "{", "}")) for c in code):
                continue
            setup = HEADER_SETUP.get(path.name)
            if setup is None:
                sys.exit(f"{rel}:{start + 1}: an example without an entry in HEADER_SETUP "
                         f"({__file__}); add one (\"\" when it needs nothing)")
            examples.append(Example(rel, start + 1, code, setup.splitlines()))
            continue
        i += 1
    return examples


def doc_examples(path, rel):
    lines = path.read_text().splitlines()
    examples = []
    i = 0
    while i < len(lines):
        if re.match(r"^```(cpp|c\+\+)\s*$", lines[i]):
            # What precedes the block: a setup comment or a not-compiled mark (blank lines allowed).
            j = i - 1
            while j >= 0 and not lines[j].strip():
                j -= 1
            setup = []
            skip = False
            if j >= 0 and lines[j].strip().startswith("<!-- example: not compiled"):
                skip = True
            elif j >= 0 and lines[j].strip() == "-->":
                k = j - 1
                while k >= 0 and lines[k].strip() != "<!-- example setup":
                    k -= 1
                if k < 0:
                    sys.exit(f"{rel}:{j + 1}: a --> without its <!-- example setup")
                setup = lines[k + 1:j]
            start = i + 1
            i += 1
            code = []
            while i < len(lines) and not lines[i].startswith("```"):
                code.append(lines[i])
                i += 1
            if not skip:
                examples.append(Example(rel, start + 1, code, setup))
        i += 1
    return examples


def emit(examples, out):
    includes = {f"blockkv/{pathlib.Path(ex.path).name}" for ex in examples
                if ex.path.startswith("include/") and not ex.requires}
    includes |= {"blockkv/blockkv.h", "blockkv/ragged_batch.h", "blockkv/state_manager.h",
                "blockkv/prefix_cache.h", "blockkv/offload.h", "blockkv/kernels.h",
                "blockkv/log.h", "blockkv/block_pool.h"}
    text = ["// Generated by tests/examples/extract_examples.py: every C++ example of blockkv's",
            "// public headers and docs. Do not edit; edit the example where #line points.",
            "// NOLINTBEGIN", ""]
    bodies = []
    mains = []
    guarded_includes = {}
    for n, ex in enumerate(examples):
        code = []
        for line in ex.code:
            stripped = line.strip()
            if stripped.startswith("#include"):
                inc = re.match(r'#include\s+[<"](.*)[>"]', stripped).group(1)
                if ex.requires:
                    guarded_includes.setdefault(frozenset(ex.requires), set()).add(inc)
                else:
                    includes.add(inc)
                code.append("")
            elif stripped.startswith("..."):
                code.append("")
            else:
                code.append(line)
        for req in ex.requires:
            if req not in GUARDS:
                sys.exit(f"{ex.path}:{ex.line}: unknown requirement '{req}'")
            guarded_includes.setdefault(frozenset(ex.requires), set()).update(REQUIRED_INCLUDES[req])
        top_level = any(re.match(r"^int main\(", l) for l in code)
        body = []
        if ex.requires:
            body.append("#if " + " && ".join(f"defined({GUARDS[r]})" for r in sorted(ex.requires)))
        if top_level:
            # A program: at global scope (its main is the one main of this file), names qualified.
            if mains:
                sys.exit(f"{ex.path}:{ex.line}: a second example with main (the first: {mains[0]})")
            mains.append(f"{ex.path}:{ex.line}")
            body += [f"// {ex.path}:{ex.line}"] + ex.setup
            body += [f'#line {ex.line} "{ex.path}"'] + code
            if ex.requires:
                body.append("#endif")
            body.append("")
            bodies += body
            continue
        body.append(f"namespace example_{n} {{  // {ex.path}:{ex.line}")
        body.append("using namespace blockkv;  // NOLINT")
        body.append("[[maybe_unused]] Status Run() {")
        body += ex.setup
        body += [f'#line {ex.line} "{ex.path}"'] + code
        body.append("  return Status::Ok();")
        body.append("}")
        body.append(f"}}  // namespace example_{n}")
        if ex.requires:
            body.append("#endif")
        body.append("")
        bodies += body
    for inc in sorted(includes):
        text.append(f"#include <{inc}>")
    text += ["#include <cstddef>", "#include <cstdint>", "#include <memory>", "#include <span>",
             "#include <string_view>", "#include <vector>", ""]
    for reqs, incs in sorted(guarded_includes.items(), key=lambda kv: sorted(kv[0])):
        text.append("#if " + " && ".join(f"defined({GUARDS[r]})" for r in sorted(reqs)))
        text += [f"#include <{inc}>" for inc in sorted(incs)]
        text.append("#endif")
    text.append("")
    text += bodies
    text.append("// NOLINTEND")
    new = "\n".join(text) + "\n"
    if not out.exists() or out.read_text() != new:
        out.write_text(new)


def main():
    if len(sys.argv) != 3:
        sys.exit(__doc__)
    root = pathlib.Path(sys.argv[1])
    examples = []
    for header in sorted((root / "include" / "blockkv").glob("*.h")):
        examples += header_examples(header, header.relative_to(root).as_posix())
    docs = [root / "README.md"] + sorted((root / "docs").glob("*.md"))
    for doc in docs:
        examples += doc_examples(doc, doc.relative_to(root).as_posix())
    out = pathlib.Path(sys.argv[2])
    emit(examples, out)
    print(f"extract_examples.py: {len(examples)} examples -> {out}")


if __name__ == "__main__":
    main()
