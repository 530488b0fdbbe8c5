# Shell functions shared by .ci/run and scripts/ci-fresh.sh: exact checks for what the CI
# steps need, and one way to install a Debian package. Sourced, not run.

# True when bindgen (clang-sys) can load libclang: a file named libclang.so, libclang.so.N,
# libclang-N.so or libclang-N.so.M in LIBCLANG_PATH or in the linker cache. libclang-cpp
# (which llvm-N-dev brings) is a different library and does not count.
have_libclang() {
  local re='^libclang(-[0-9][0-9.]*)?\.so(\.[0-9]+)*$'
  if [ -n "${LIBCLANG_PATH:-}" ] && [ -d "$LIBCLANG_PATH" ]; then
    local f
    for f in "$LIBCLANG_PATH"/*; do
      [[ "$(basename "$f")" =~ $re ]] && return 0
    done
  fi
  # The whole list first: under `set -o pipefail`, a `grep -q` that stops at the first match
  # can kill the writer with SIGPIPE and fail the pipeline although it matched.
  local libs
  libs="$(ldconfig -p 2>/dev/null | awk '{print $1}')" || true
  grep -Eq "$re" <<<"$libs"
}

# True when `python3 -m pip` runs (scripts/fetch-nccl.sh downloads NCCL's wheels with it).
have_pip() {
  command -v python3 >/dev/null 2>&1 && python3 -m pip --version >/dev/null 2>&1
}

# apt_install PKG...: installs Debian packages, as root or through sudo.
apt_install() {
  local sudo_cmd=""
  [ "$(id -u)" = 0 ] || sudo_cmd="sudo"
  export DEBIAN_FRONTEND=noninteractive
  $sudo_cmd apt-get update -qq
  $sudo_cmd apt-get install -y -qq "$@" >/dev/null
}
