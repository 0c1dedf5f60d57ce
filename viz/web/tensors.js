// 4. Tensors: every saved tensor with its storage and why, filterable by a
// glob over names (as policy annotations match) and sortable.
"use strict";
MP.views.tensors = (section, data) => {
  const parent = section.querySelector(".tables");
  // Largest first: the rows shown before "show all" are the ones that matter.
  const rows = data.tensors.map(([name, module, layer, pp, bytes, device, policy, to, addedMs]) =>
    ({ name, module, layer, pp, bytes, device, policy, to, addedMs, saved: bytes - device }))
    .sort((a, b) => b.bytes - a.bytes || (a.name < b.name ? -1 : 1));
  const input = MP.el("input", { class: "filter", type: "text", placeholder: "glob, e.g. *.moe.* or layer3.*" });
  const count = MP.el("span", { class: "note" });
  parent.append(MP.el("div", {}, [input, " ", count]));
  const table = MP.table(parent, [
    { name: "tensor", key: (r) => r.name, text: true },
    { name: "module", key: (r) => r.module, text: true },
    { name: "layer", key: (r) => r.layer },
    { name: "pp rank", key: (r) => r.pp },
    { name: "bytes/mb", key: (r) => r.bytes, fmt: MP.fmtBytes },
    { name: "policy", key: (r) => r.policy + (r.to != null ? " → pp" + r.to : ""), text: true },
    { name: "device/mb", key: (r) => r.device, fmt: MP.fmtBytes },
    { name: "saved/mb", key: (r) => r.saved, fmt: MP.fmtBytes },
    { name: "added (ms, step)", key: (r) => r.addedMs, fmt: (v) => v.toFixed(3) },
  ], rows, { sortable: true, limit: 25 });
  const apply = () => {
    const g = input.value.trim();
    let shown = rows;
    if (g) {
      try { const re = MP.globRegex(g); shown = rows.filter((r) => re.test(r.name)); } catch (e) { shown = []; }
    }
    count.textContent = `${shown.length} of ${rows.length} tensors match`;
    table.set(shown);
  };
  input.addEventListener("input", apply);
  apply();
};
