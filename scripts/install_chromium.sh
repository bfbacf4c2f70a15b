#!/usr/bin/env bash
# The web test drives a real headless Chromium: Debian's `chromium` package, through Playwright with
# executable_path=/usr/bin/chromium (Playwright's own browser download is never used). Install it once;
# a second run does nothing.
set -euo pipefail
if [ -x /usr/bin/chromium ]; then
    exit 0
fi
if [ "$(id -u)" != 0 ]; then
    echo "warning: /usr/bin/chromium is missing and this is not root:" \
         "run 'sudo apt-get install chromium fonts-dejavu-core' (the web browser test needs it)" >&2
    exit 0
fi
apt-get update -qq
DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends chromium fonts-dejavu-core >/dev/null
/usr/bin/chromium --version
