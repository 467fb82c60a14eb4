// Loads one page and its assets over HTTPS in headless Chromium (Debian's), for
// crates/quill/tests/requests.rs, which starts the server (quill with TLS in front of
// NGINX) and judges what this script saw: it prints one line "REPORT <json>" and exits
// 0, or prints "FAIL <why>" and exits 1. The script asserts nothing about the page
// itself; the test does.
//
// What the report holds:
//   responses: every response the browser received, from the DevTools protocol's
//              Network.responseReceived (url, status, protocol, connectionId), the page's
//              own included
//   failed:    requests that failed (Network.loadingFailed: url, errorText)
//   navigation, resources: the page's Resource Timing entries (name, nextHopProtocol,
//              responseStatus)
//   scripts:   the numbers the page's scripts pushed onto window.ran as they ran
//   images:    each <img>'s src and naturalWidth (0 when it did not decode)
//   styles:    each stylesheet's rule applied, read back as the computed width of
//              its probe element
//   errors:    exceptions and console errors of the page
//
// Environment: PAGE_URL, CERT (the server's certificate, PEM), CHROMIUM (executable),
// PROFILE_DIR (a fresh user data directory); NETLOG (optional, for debugging): a file
// for Chromium's net log, every socket and its bytes.
import { fail, launch } from "./launch.mjs";
import { mkdirSync, writeFileSync } from "node:fs";
import { join } from "node:path";

const url = process.env.PAGE_URL;
const deadline = 30_000;

// No speculative connections: by default Chromium preconnects to the origin it navigates
// to (one socket, then two more), beside the connection its requests then use, so
// quill's count of client connections would depend on Chromium's timing. The profile's
// preferences turn network prediction off ("never").
mkdirSync(join(process.env.PROFILE_DIR, "Default"), { recursive: true });
writeFileSync(join(process.env.PROFILE_DIR, "Default", "Preferences"),
  JSON.stringify({ net: { network_prediction_options: 2 } }));

const context = await launch();

try {
  const page = context.pages()[0] ?? (await context.newPage());
  const errors = [];
  page.on("pageerror", (e) => errors.push(e.message));
  page.on("console", (m) => { if (m.type() === "error") errors.push(m.text()); });

  // The DevTools protocol tells the protocol and the connection of every response.
  const cdp = await context.newCDPSession(page);
  const responses = [];
  const failed = [];
  cdp.on("Network.responseReceived", (e) => responses.push({
    url: e.response.url,
    status: e.response.status,
    protocol: e.response.protocol,
    connectionId: e.response.connectionId,
  }));
  cdp.on("Network.loadingFailed", (e) => failed.push({ id: e.requestId, errorText: e.errorText }));
  await cdp.send("Network.enable");

  await page.goto(url, { waitUntil: "load", timeout: deadline });
  // The DevTools events come on their own channel: wait until every request the page
  // made (its assets and itself) has been reported as answered or failed.
  const made = 1 + (await page.evaluate(() => performance.getEntriesByType("resource").length));
  const until = Date.now() + deadline;
  while (responses.length + failed.length < made && Date.now() < until) {
    await new Promise((resolve) => setTimeout(resolve, 20));
  }

  const seen = await page.evaluate(() => ({
    navigation: performance.getEntriesByType("navigation").map((e) => ({
      name: e.name, nextHopProtocol: e.nextHopProtocol, responseStatus: e.responseStatus,
    })),
    resources: performance.getEntriesByType("resource").map((e) => ({
      name: e.name, nextHopProtocol: e.nextHopProtocol, responseStatus: e.responseStatus,
    })),
    scripts: window.ran ?? [],
    images: [...document.images].map((i) => ({ src: i.src, naturalWidth: i.naturalWidth })),
    styles: [...document.querySelectorAll("[data-probe]")].map((p) => ({
      probe: p.dataset.probe, width: getComputedStyle(p).width,
    })),
  }));
  console.log("REPORT " + JSON.stringify({ responses, failed, errors, ...seen }));
} catch (e) {
  await context.close().catch(() => {});
  fail(e);
}
await context.close();
