"""Photograph one tab of a Prefect UI page with headless Chromium over the DevTools protocol.

`chromium --screenshot` cannot click, and the flow run page only offers its Artifacts tab once the run
has loaded, so this opens the page, clicks the tab by its label, waits for it to render and saves a PNG.

    python docs/photograph.py URL TAB OUTPUT.png [WIDTH HEIGHT]
"""

from __future__ import annotations

import asyncio
import base64
import itertools
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request

import websockets

CLICK_TAB = """(() => {
  const all = [...document.querySelectorAll('*')].filter(e => e.textContent.trim() === %s);
  const tab = all[all.length - 1];  // the innermost element with exactly that label
  if (tab) tab.click();
  return Boolean(tab);
})()"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def photograph(ws_url: str, url: str, tab: str, output: str, width: int, height: int) -> None:
    ids = itertools.count(1)
    async with websockets.connect(ws_url, max_size=None) as ws:

        async def call(method: str, **params):
            msg_id = next(ids)
            await ws.send(json.dumps({"id": msg_id, "method": method, "params": params}))
            while True:
                reply = json.loads(await ws.recv())
                if reply.get("id") == msg_id:
                    return reply.get("result", {})

        await call("Emulation.setDeviceMetricsOverride", width=width, height=height, deviceScaleFactor=1, mobile=False)
        await call("Page.navigate", url=url)
        for _ in range(60):  # the tab appears once the run has loaded
            await asyncio.sleep(1)
            found = await call("Runtime.evaluate", expression=CLICK_TAB % json.dumps(tab), returnByValue=True)
            if found.get("result", {}).get("value"):
                break
        else:
            raise SystemExit(f"no tab {tab!r} on {url}")
        await asyncio.sleep(6)  # let the artifacts render
        shot = await call("Page.captureScreenshot", format="png")
        with open(output, "wb") as handle:
            handle.write(base64.b64decode(shot["data"]))


def main() -> None:
    url, tab, output = sys.argv[1:4]
    width, height = (int(v) for v in (sys.argv[4:6] or (1400, 1500)))
    port = free_port()
    profile = tempfile.mkdtemp()
    chromium = subprocess.Popen(
        [os.environ.get("CHROMIUM", "chromium"), "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
         f"--remote-debugging-port={port}", f"--user-data-dir={profile}", "about:blank"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )
    try:
        for _ in range(60):
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/json/list") as reply:
                    pages = [p for p in json.load(reply) if p["type"] == "page"]
                if pages:
                    break
            except OSError:
                pass
            time.sleep(0.5)
        asyncio.run(photograph(pages[0]["webSocketDebuggerUrl"], url, tab, output, width, height))
    finally:
        chromium.terminate()
        chromium.wait()
        shutil.rmtree(profile, ignore_errors=True)


if __name__ == "__main__":
    main()
