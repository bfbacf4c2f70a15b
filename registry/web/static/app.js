// Quantyard pages: client-side table sorting and copy buttons. No dependencies, served locally.
"use strict";

function cellValue(row, index, type) {
  const cell = row.cells[index];
  const raw = cell ? cell.getAttribute("data-v") : null;
  if (raw === null || raw === "") return null; // missing values always sort last
  return type === "num" ? parseFloat(raw) : raw.toLowerCase();
}

function sortTable(table, th, descending) {
  const index = Array.prototype.indexOf.call(th.parentNode.children, th);
  const type = th.getAttribute("data-type");
  const body = table.tBodies[0];
  const rows = Array.from(body.rows).filter((r) => r.hasAttribute("data-ref"));
  const keyed = rows.map((row, i) => ({ row, i, v: cellValue(row, index, type) }));
  keyed.sort((a, b) => {
    if (a.v === null || b.v === null) return (a.v === null) - (b.v === null) || a.i - b.i;
    const c = a.v < b.v ? -1 : a.v > b.v ? 1 : 0;
    return (descending ? -c : c) || a.i - b.i;
  });
  keyed.forEach((k) => body.appendChild(k.row));
  for (const other of th.parentNode.children) other.removeAttribute("aria-sort");
  th.setAttribute("aria-sort", descending ? "descending" : "ascending");
  const url = new URL(window.location.href);
  url.searchParams.set("sort", th.getAttribute("data-key"));
  url.searchParams.set("dir", descending ? "desc" : "asc");
  window.history.replaceState(null, "", url);
}

function initSorting() {
  for (const table of document.querySelectorAll("table.sortable")) {
    for (const th of table.querySelectorAll("th[data-key]")) {
      const link = th.querySelector("a.sort");
      if (!link) continue;
      link.addEventListener("click", (event) => {
        event.preventDefault();
        sortTable(table, th, th.getAttribute("aria-sort") === "ascending");
      });
    }
  }
}

function initCopy() {
  for (const button of document.querySelectorAll("button.copy")) {
    button.addEventListener("click", () => {
      const text = document.getElementById(button.getAttribute("data-copy")).innerText;
      const done = () => { button.textContent = "copied"; setTimeout(() => { button.textContent = "copy"; }, 1500); };
      if (navigator.clipboard && window.isSecureContext) {
        navigator.clipboard.writeText(text).then(done, () => { button.textContent = "select and copy"; });
      } else {
        const range = document.createRange();
        range.selectNodeContents(document.getElementById(button.getAttribute("data-copy")));
        const sel = window.getSelection();
        sel.removeAllRanges();
        sel.addRange(range);
        button.textContent = "selected: press Ctrl+C";
      }
    });
  }
}

function initCompare() {
  const form = document.getElementById("compare-form");
  if (!form) return;
  const button = document.getElementById("compare-button");
  const update = () => {
    const n = form.querySelectorAll("input[name=ref]:checked").length;
    button.disabled = n < 2 || n > 6;
    button.textContent = `Compare selected (${n}, 2–6)`;
  };
  form.addEventListener("change", update);
  update();
}

document.addEventListener("DOMContentLoaded", () => { initSorting(); initCopy(); initCompare(); });
