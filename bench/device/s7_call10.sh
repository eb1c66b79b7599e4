#!/bin/bash
# Session 7, device calls 7 and 10 (issue 24): treerl auto against the DTA authors engine on the long shapes, same call
# (carry [".dta"]). Call 7 (default budget 20%, dfs too):
#   MAX_S=500 bash bench/device/dta_compare.sh --shapes long_prefix,episodes --no-grad-check --repeats 2
# Call 10 (default budget 25%):
MAX_S=400 bash bench/device/dta_compare.sh --shapes long_prefix,episodes --engines auto,dta --no-grad-check --repeats 2
