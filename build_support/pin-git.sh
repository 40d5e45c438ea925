#!/bin/sh
# What llama.cpp's and ggml's CMake ask git, answered for the pinned sdist's tree, which has no git
# history (its .git names a folder that is not there): the pin's commit, a clean tree. Anything
# else fails quietly, and their CMake keeps its defaults. CMakeLists.txt sets PYLLAMACPP_PIN_COMMIT.
case "$*" in
  --version) echo "git version 2.0.0 (pyllamacpp: the pinned llama.cpp has no git history)" ;;
  "rev-parse --short HEAD") echo "$PYLLAMACPP_PIN_COMMIT" | cut -c1-7 ;;
  "rev-parse HEAD") echo "$PYLLAMACPP_PIN_COMMIT" ;;
  "diff-index --quiet HEAD -- .") exit 0 ;;
  *) exit 1 ;;
esac
