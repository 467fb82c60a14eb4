// Drives quill's dashboard in headless Chromium (Debian's), for
// crates/quill/tests/metrics.rs, which starts quill and the traffic and reads this
// script's stdout: it prints "BLACKLISTED 0" once the page shows server 0 blacklisted,
// waits for "CONTINUE" on stdin (the test checks that traffic moved meanwhile), then
// takes the screenshot and prints "DONE". Any failure prints "FAIL <why>" and exits 1.
//
// Environment: DASHBOARD_URL, CHROMIUM (executable), PROFILE_DIR (a fresh user data
// directory), SCREENSHOT (PNG path).
import { fail, launch } from "./launch.mjs";
import { createInterface } from "node:readline";

const url = process.env.DASHBOARD_URL;
const deadline = 30_000;

function nextLine() {
  const rl = createInterface({ input: process.stdin });
  return new Promise((resolve) => rl.once("line", (l) => { rl.close(); resolve(l); }));
}

const context = await launch({ viewport: { width: 1280, height: 900 } });

try {
  const page = context.pages()[0] ?? (await context.newPage());
  const errors = [];
  page.on("pageerror", (e) => errors.push(e.message));
  page.on("console", (m) => { if (m.type() === "error") errors.push(m.text()); });

  await page.goto(url, { timeout: deadline });

  // Both servers listed, up, with traffic (their totals grow while the page polls).
  const rows = page.locator("#servers tbody tr[data-server]");
  await rows.nth(1).waitFor({ timeout: deadline });
  const count = await rows.count();
  if (count !== 2) fail("expected 2 servers, the page shows " + count);
  for (const i of ["0", "1"]) {
    const row = page.locator(`#servers tr[data-server="${i}"]`);
    await row.locator(".badge.up").waitFor({ timeout: deadline });
  }
  await page.waitForFunction(
    () => [...document.querySelectorAll("#servers tr[data-server] td.total")]
      .every((td) => Number(td.textContent.replace(/,/g, "")) > 0),
    null, { timeout: deadline });
  // The chart has drawn its lines, and clients are listed.
  await page.locator("#chart path.rate-line").waitFor({ timeout: deadline });
  await page.locator("#clients tbody td.mono").first().waitFor({ timeout: deadline });

  // Blacklist server 0 with its button; the page shows the new state.
  const row0 = page.locator('#servers tr[data-server="0"]');
  await row0.locator('button[data-action="blacklist"]').click({ timeout: deadline });
  await page.locator('#servers tr[data-server="0"][data-state="blacklisted"]').waitFor({ timeout: deadline });
  await row0.locator('button[data-action="whitelist"]').waitFor({ timeout: deadline });
  console.log("BLACKLISTED 0");

  if ((await nextLine()) !== "CONTINUE") fail("the test did not say CONTINUE");
  // Traffic moved: server 0's per-second rate falls to 0 while server 1 keeps serving.
  await page.waitForFunction(
    () => {
      const rate = (i) => document.querySelector(`#servers tr[data-server="${i}"] td.rate`)?.textContent;
      return rate("0") === "0.00" && Number(rate("1")) > 0;
    },
    null, { timeout: deadline });
  if (errors.length > 0) fail("errors in the page: " + errors.join("; "));
  await page.screenshot({ path: process.env.SCREENSHOT, fullPage: true });
  console.log("DONE");
} catch (e) {
  fail(e && e.message ? e.message : e);
} finally {
  await context.close().catch(() => {});
}
process.exit(0);
