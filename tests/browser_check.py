"""Check an HTML report in a real browser: images load, nothing overflows, no script error; screenshots.

:func:`check` copies the page with a small probe script prepended (it records
script errors from the start and, once the page has loaded, measures it),
opens the copy in headless Chromium (``chromium-headless-shell`` or
``chromium``, found on ``PATH``) at ``width`` pixels with ``--dump-dom``, and
reads the probe's JSON back from the dumped DOM:

* ``images`` / ``broken``: how many ``<img>`` there are, and the alt text of
  those that did not decode (``naturalWidth == 0``);
* ``overflow``: elements whose right edge passes the viewport (tag, id or
  class, right edge in px), and ``scroll_width`` of the document, which must
  not exceed ``width``;
* ``errors``: script errors (``window.onerror`` and unhandled rejections).

With ``screenshot`` it also saves a PNG of the first ``height`` pixels.
:func:`find_browser` is None where no browser is installed.
"""
from __future__ import annotations

import json
import re
import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import Optional

BROWSERS = ("chromium-headless-shell", "chromium", "chromium-browser", "google-chrome", "headless_shell")

_PROBE = """<script>
window.__fedprobErrors = [];
window.addEventListener('error', function (e) { window.__fedprobErrors.push(String(e.message || e)); });
window.addEventListener('unhandledrejection', function (e) { window.__fedprobErrors.push(String(e.reason)); });
window.addEventListener('load', function () {
  var W = window.innerWidth, over = [], imgs = document.images, broken = [];
  for (var i = 0; i < imgs.length; i++) {
    if (!imgs[i].complete || imgs[i].naturalWidth === 0) { broken.push(imgs[i].alt || String(i)); }
  }
  var all = document.body.getElementsByTagName('*');
  for (var j = 0; j < all.length; j++) {
    var el = all[j], r = el.getBoundingClientRect();
    if (r.width === 0 || el.closest('.scroll') && el.className !== 'scroll') { continue; }
    if (r.right > W + 1) { over.push(el.tagName + (el.id ? '#' + el.id : '') +
                                     (el.className ? '.' + el.className : '') + ' ' + Math.round(r.right)); }
  }
  var out = {width: W, scroll_width: document.documentElement.scrollWidth, images: imgs.length,
             broken: broken, overflow: over.slice(0, 20), errors: window.__fedprobErrors};
  var pre = document.createElement('pre');
  pre.id = 'fedprob-probe';
  pre.textContent = JSON.stringify(out);
  document.body.appendChild(pre);
});
</script>"""


def find_browser() -> Optional[str]:
    """The path of a headless-capable Chromium on PATH, or None."""
    for name in BROWSERS:
        path = shutil.which(name)
        if path:
            return path
    return None


def _run(browser: str, args: list, timeout: float) -> str:
    cmd = [browser, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
           "--allow-file-access-from-files", *args]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0:
        raise RuntimeError(f"{Path(browser).name} exited with {proc.returncode}: {proc.stderr[-2000:]}")
    return proc.stdout


def check(page, width: int = 1280, height: int = 900, screenshot=None, browser: Optional[str] = None,
          timeout: float = 120.0) -> dict:
    """The probe's measurements of ``page`` (see the module docstring) at ``width`` px."""
    browser = browser or find_browser()
    if browser is None:
        raise FileNotFoundError("no Chromium found on PATH (apt-get install chromium-headless-shell)")
    page = Path(page)
    text = page.read_text()
    probed = re.sub(r"(<head[^>]*>)", lambda m: m.group(1) + _PROBE, text, count=1)
    with tempfile.TemporaryDirectory() as tmp:
        copy = Path(tmp) / page.name
        copy.write_text(probed)
        dom = _run(browser, [f"--window-size={width},{height}", "--virtual-time-budget=10000", "--dump-dom",
                             copy.as_uri()], timeout)
        if screenshot is not None:
            _run(browser, [f"--window-size={width},{height}", f"--screenshot={Path(screenshot).resolve()}",
                           page.resolve().as_uri()], timeout)
    m = re.search(r'<pre id="fedprob-probe">(.*?)</pre>', dom, re.S)
    if m is None:
        raise RuntimeError("the page's probe reported nothing (the page did not finish loading)")
    import html

    return json.loads(html.unescape(m.group(1)))


__all__ = ["check", "find_browser", "BROWSERS"]
