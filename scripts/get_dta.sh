#!/usr/bin/env bash
# Recreates ./.dta: the DTA authors' tree training engine (github.com/Whisper-6/DynamicTreeAttn,
# MIT licence), for bench/dta_compare.py only. Not part of treerl: .dta/ is git-ignored and
# travels to a GPU machine as is (e.g. the device tool's `carry: [".dta"]`; ~70 KB).
#
#   scripts/get_dta.sh                 # from $DTA_GIT_DIR if set, else a local mirror, else GitHub
#   DTA_GIT_DIR=/path/repo.git scripts/get_dta.sh
#
# Copies the four modules the engine needs at a pinned commit and makes one patch:
# vocab_parallel.py imports `is_npu_available` from AReaL (not installed; only chooses whether
# to torch.compile the log-prob head) -> a constant False (compile, as on their CUDA runs).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
COMMIT=62d52d3c9fd81e5c396f84adf78bc9bbb8ea4a3c   # "Update TimeModel", 2026-02-04 (the repository's HEAD)
FILES="tree_training_engine.py token_trie.py trie.py vocab_parallel.py LICENSE"
MIRROR=/work/.mirror/Whisper-6+DynamicTreeAttn/repo

tmp=""
if [ -n "${DTA_GIT_DIR:-}" ]; then
    git_dir=$DTA_GIT_DIR
elif [ -d "$MIRROR" ]; then
    git_dir=$MIRROR
else
    tmp=$(mktemp -d)
    trap 'rm -rf "$tmp"' EXIT
    git clone -q --bare https://github.com/Whisper-6/DynamicTreeAttn.git "$tmp/repo"
    git_dir=$tmp/repo
fi

rm -rf .dta
mkdir -p .dta
for f in $FILES; do
    git --git-dir="$git_dir" show "$COMMIT:$f" > ".dta/$f"
done
# The only patch: AReaL's platform probe -> "not an NPU" (the engine is otherwise unchanged).
grep -q '^from areal.platforms import is_npu_available$' .dta/vocab_parallel.py
sed -i 's/^from areal.platforms import is_npu_available$/is_npu_available = False  # patched by scripts\/get_dta.sh: AReaL is not installed/' \
    .dta/vocab_parallel.py
printf 'github.com/Whisper-6/DynamicTreeAttn %s\npatched: vocab_parallel.py (areal.platforms.is_npu_available -> False)\n' \
    "$COMMIT" > .dta/SOURCE
echo "wrote .dta/ ($(du -sh .dta | cut -f1)) from $COMMIT"
