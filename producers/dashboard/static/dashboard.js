// batchd dashboard: live sections over Server-Sent Events, and a job's tokens as they come.
// No framework and no build step. HTML from the server arrives escaped (Jinja2 autoescape);
// text from a job is only ever set with textContent / text nodes, never parsed as HTML.
(() => {
  "use strict";

  const liveDot = document.querySelector("[data-live-state]");
  const setLive = (state, title) => {
    if (!liveDot) return;
    liveDot.dataset.liveState = state;
    liveDot.title = title;
  };
  const csrfToken = () => {
    const meta = document.querySelector('meta[name="csrf-token"]');
    return meta ? meta.content : "";
  };

  // Forms: ask before a destructive action; carry the session's CSRF token (live sections
  // are rendered once for every operator, so their forms cannot hold it themselves).
  document.addEventListener("submit", (event) => {
    const form = event.target;
    if (!(form instanceof HTMLFormElement) || form.method.toLowerCase() !== "post") return;
    const question = form.dataset.confirm;
    if (question && !window.confirm(question)) {
      event.preventDefault();
      return;
    }
    if (!form.querySelector('input[name="csrf"]') && csrfToken()) {
      const input = document.createElement("input");
      input.type = "hidden";
      input.name = "csrf";
      input.value = csrfToken();
      form.appendChild(input);
    }
  });

  document.addEventListener("change", (event) => {
    const box = event.target;
    if (!(box instanceof HTMLInputElement) || !box.matches("[data-select-all]")) return;
    const table = box.closest("table");
    if (!table) return;
    for (const other of table.querySelectorAll('input[type="checkbox"][name="entry"]')) {
      other.checked = box.checked;
    }
  });

  // Replace a section's HTML, keeping what the user was doing in it: ticked boxes and
  // opened details survive a refresh.
  const replaceSection = (element, html) => {
    if (element.innerHTML === html) return;
    const ticked = new Set(
      [...element.querySelectorAll('input[type="checkbox"]:checked')].map((b) => b.value),
    );
    const opened = new Set(
      [...element.querySelectorAll("details[open]")].map((d) => d.closest("[id]")?.id),
    );
    element.innerHTML = html;
    for (const box of element.querySelectorAll('input[type="checkbox"]')) {
      if (ticked.has(box.value)) box.checked = true;
    }
    for (const details of element.querySelectorAll("details")) {
      if (opened.has(details.closest("[id]")?.id)) details.open = true;
    }
  };

  const followSections = (url) => {
    const source = new EventSource(url);
    source.addEventListener("open", () => setLive("on", "live"));
    source.addEventListener("error", () => setLive("off", "reconnecting…"));
    source.addEventListener("sections", (event) => {
      const sections = JSON.parse(event.data);
      for (const [name, html] of Object.entries(sections)) {
        const element = document.querySelector(`[data-section="${CSS.escape(name)}"]`);
        if (element) replaceSection(element, html);
      }
    });
  };

  const followJob = (root) => {
    let seq = Number(root.dataset.seq);
    const outputs = root.querySelector("[data-outputs]");
    const counter = root.querySelector("[data-token-count]");
    const status = root.querySelector('[data-section="status"]');
    const output = (index) => {
      let pre = outputs.querySelector(`pre[data-index="${index}"]`);
      if (!pre) {
        const box = document.createElement("div");
        box.className = "output";
        const title = document.createElement("h3");
        title.textContent = `Sequence ${index}`;
        pre = document.createElement("pre");
        pre.className = "text";
        pre.dataset.index = String(index);
        box.append(title, pre);
        outputs.appendChild(box);
      }
      return pre;
    };
    const showCount = () => {
      if (counter) counter.textContent = `${seq + 1} event(s)`;
    };
    const url = new URL(root.dataset.stream, window.location.href);
    url.searchParams.set("after", String(seq));
    const source = new EventSource(url);
    source.addEventListener("open", () => setLive("on", "live"));
    source.addEventListener("error", () => setLive("off", "reconnecting…"));
    source.addEventListener("tokens", (event) => {
      for (const token of JSON.parse(event.data)) {
        if (token.seq <= seq) continue; // already shown (a replay after reconnecting)
        seq = token.seq;
        output(token.index).append(document.createTextNode(token.text));
      }
      root.dataset.seq = String(seq);
      showCount();
    });
    source.addEventListener("status", (event) => {
      if (status) replaceSection(status, JSON.parse(event.data).status);
    });
    source.addEventListener("final", (event) => {
      const data = JSON.parse(event.data);
      for (const [index, text] of Object.entries(data.texts)) output(index).textContent = text;
      if (status && data.status) replaceSection(status, data.status);
      if (event.lastEventId) seq = Number(event.lastEventId);
      root.dataset.seq = String(seq);
      root.dataset.ended = "1";
      showCount();
      source.close();
      setLive("done", "job ended");
    });
    source.addEventListener("gone", () => {
      source.close();
      setLive("off", "job expired");
    });
  };

  const job = document.querySelector("[data-job]");
  if (job && job.dataset.ended !== "1") followJob(job);
  const live = document.body.dataset.liveSrc;
  if (live) followSections(live);
})();
