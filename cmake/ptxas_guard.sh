#!/usr/bin/env bash
# Compiler launcher of the CUDA sources (CMakeLists.txt): runs the compile, whose flags ask ptxas
# for its report (-v), and fails it when ptxas serialised a wgmma pipeline (messages C7510-C7520:
# info level, so without this they would neither fail the build nor show). The report's routine
# lines are dropped; everything else is passed on.
out=$("$@" 2>&1)
status=$?
[[ -z $out ]] || grep -v -e "^ptxas info    : " -e "^    [0-9]* bytes stack frame" <<<"$out" >&2
if grep -q "Potential Performance Loss: wgmma" <<<"$out"; then
  grep "^ptxas info    : (C75" <<<"$out" >&2
  echo "ptxas serialised the wgmma pipeline (messages above): the tensor cores would idle between wgmmas" >&2
  exit 1
fi
exit $status
