"""The report's stylesheet, inline in the page (nothing fetched: the system's own fonts), light or dark as the
reader's system prefers. The curves keep their white background in both."""

STYLE = """
:root { color-scheme: light dark; --fg: #1f2328; --muted: #59636e; --bg: #ffffff; --stripe: #f6f8fa;
  --head: #eef1f4; --border: #d1d9e0; --accent: #0969da; --better: #1a7f37; --worse: #cf222e; }
@media (prefers-color-scheme: dark) {
  :root { --fg: #e6edf3; --muted: #9198a1; --bg: #0d1117; --stripe: #151b23; --head: #1c232c; --border: #3d444d;
    --accent: #4493f8; --better: #3fb950; --worse: #f85149; }
}
* { box-sizing: border-box; }
body { margin: 0; background: var(--bg); color: var(--fg);
  font: 15px/1.5 system-ui, -apple-system, "Segoe UI", Roboto, "Helvetica Neue", Arial, sans-serif; }
main { max-width: 72rem; margin: 0 auto; padding: 1.5rem 1.25rem 4rem; }
header { border-bottom: 1px solid var(--border); padding-bottom: 0.8rem; }
h1 { font-size: 1.6rem; margin: 0 0 0.4rem; overflow-wrap: anywhere; }
h2 { font-size: 1.25rem; margin: 2.2rem 0 0.6rem; padding-bottom: 0.2rem; border-bottom: 1px solid var(--border); }
h3 { font-size: 1rem; margin: 1.3rem 0 0.3rem; }
a { color: var(--accent); }
code, td.text, td.path { font-family: ui-monospace, SFMono-Regular, Menlo, Consolas, monospace; font-size: 0.85rem; }
dl.facts { display: grid; grid-template-columns: max-content 1fr; gap: 0.1rem 1.2rem; margin: 0; }
dl.facts dt { color: var(--muted); }
dl.facts dd { margin: 0; overflow-wrap: anywhere; }
p.headline { font-size: 1.3rem; margin: 0.6rem 0; }
p.headline strong { font-variant-numeric: tabular-nums; }
.better { color: var(--better); }
.worse { color: var(--worse); }
.note { color: var(--muted); font-size: 0.9rem; }
.scroll { overflow-x: auto; }
table { border-collapse: collapse; margin: 0.4rem 0 1rem; font-size: 0.9rem; }
th, td { border: 1px solid var(--border); padding: 0.3rem 0.65rem; text-align: left; vertical-align: top; }
thead th { background: var(--head); }
tbody tr:nth-child(even) { background: var(--stripe); }
th.num, td.num { text-align: right; font-variant-numeric: tabular-nums; white-space: nowrap; }
td.text { white-space: pre-wrap; max-width: 40em; overflow-wrap: anywhere; }
td.path { overflow-wrap: anywhere; }
tr.headline td { font-weight: 600; }
div.curves { background: #ffffff; border: 1px solid var(--border); border-radius: 6px; padding: 0.4rem; }
div.curves svg { display: block; max-width: 100%; height: auto; }
details > summary { cursor: pointer; color: var(--accent); margin: 0.4rem 0; }
"""
