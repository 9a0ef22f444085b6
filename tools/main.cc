// SPDX-License-Identifier: Apache-2.0
// blockkv: the command-line tool. `blockkv plan` (how much fits), `blockkv simulate` (a request
// trace through the cache's bookkeeping), `blockkv demo` (a tiny Llama through the paged path,
// checked against a dense cache). Exit codes and messages: cli.cc, docs/tool.md.
#include <cstddef>

#include "cli.h"

int main(int argc, char** argv) {
  return blockkv::tool::RunCli({argv, static_cast<size_t>(argc)}, {});
}
