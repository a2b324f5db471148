# Sourced by bin/launch and bin/test: make .venv (once) and install zmqps into it.
# Usage: zmqps_venv EXTRAS   (e.g. "test"; empty for none)
zmqps_venv() {
  local py=${PYTHON:-python3}
  if [ ! -x .venv/bin/python ]; then
    if ! "$py" -m venv .venv 2>/dev/null; then
      # Debian's python3 ships venv separately.
      rm -rf .venv
      if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
        apt-get update -qq && apt-get install -y -qq python3-venv >/dev/null
      fi
      "$py" -m venv .venv
    fi
  fi
  local spec=.
  [ -n "${1:-}" ] && spec=".[$1]"
  .venv/bin/python -m pip install -q --disable-pip-version-check -e "$spec"
}
