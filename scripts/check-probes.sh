#!/usr/bin/env bash
# Checks that applications which pick cudarc's CUDA version and linking mode themselves can
# depend on nccl-safe (`cargo check` of the crates under probes/, each its own workspace):
#   probes/candle        candle-core 0.11's cudarc features (dynamic-linking, f8, ...)
#   probes/cubecl        cubecl-cuda 0.12's cudarc features (fallbacks only, nccl)
#   probes/pinned-12060  cuda-12060 + dynamic-linking
# For each it prints what cudarc's build script decided (CUDA version, linking, libraries),
# and it fails unless the pinned probe got CUDA 12.6 and libcuda linked, not loaded; the
# pinned probe's code also asserts both at compile time. Needs no CUDA toolkit. Each probe's
# Cargo.lock pins its crates; a dependency nccl-safe gains later is added to it on the fly.
set -euo pipefail
cd "$(dirname "$0")/.."
root="$PWD"
export CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-$root/target}/probes"

# check PROBE EXPECT: `cargo check` the probe, then compare cudarc's build-script output
# with EXPECT ("any", or e.g. "12.6 linked").
check() {
  local probe="$1" expect="$2" json
  echo "-- probes/$probe"
  json="$(cd "probes/$probe" && cargo check --quiet --message-format=json)" || {
    echo "probes/$probe does not build beside nccl-safe" >&2
    return 1
  }
  printf '%s\n' "$json" | python3 -c "$summarize" "$expect"
}

# Reads cargo's JSON messages; prints and checks what cudarc's build script emitted.
summarize='
import json, sys
expect = sys.argv[1]
outs = [m for m in map(json.loads, sys.stdin)
        if m.get("reason") == "build-script-executed" and "cudarc" in m["package_id"]]
if len(outs) != 1:
    sys.exit("expected one cudarc build script, found %d" % len(outs))
m = outs[0]
env = dict(m["env"])
version = "%s.%s" % (env["CUDA_MAJOR_VERSION"], env["CUDA_MINOR_VERSION"])
loading = "feature=\"dynamic-loading\"" in m["cfgs"]
linked = "dylib=cuda" in m["linked_libs"]
mode = "loaded" if loading else ("linked" if linked else "neither")
print("   cudarc: CUDA %s, libcuda %s, links %s" % (version, mode, m["linked_libs"] or "nothing"))
if expect != "any" and expect != version + " " + mode:
    sys.exit("   expected CUDA and libcuda: " + expect)
'


check candle any
check cubecl any
check pinned-12060 "12.6 linked"
# The whole output, then its first line: `| head -n 1` under pipefail can fail on SIGPIPE.
tree="$(cd probes/pinned-12060 && cargo tree -e features -i cudarc --prefix none --format '{f}')"
features="${tree%%$'\n'*}"
echo "-- cudarc features of the pinned probe: $features"
case ",$features," in
  *,dynamic-loading,* | *,static-linking,*) echo "a linking mode was forced on the pinned probe" >&2; exit 1 ;;
esac
versions="$(tr ',' '\n' <<<"$features" | grep -E '^cuda-[0-9]+$' || true)"
[ "$versions" = cuda-12060 ] || { echo "CUDA versions forced on the pinned probe: $versions" >&2; exit 1; }
