"""The HTML report's style: the page's Content-Security-Policy and its inline CSS (screen and print)."""

PAGE_CSP = "default-src 'none'; style-src 'unsafe-inline'; img-src data:; base-uri 'none'; form-action 'none'"

PAGE_CSS = """
:root{--fg:#1d2330;--muted:#5f6b7a;--line:#dde2e8;--bg:#fff;--soft:#f5f7fa;--red:#c62828;--green:#2e7d32;
--amber:#a86500;--blue:#1f5fa8;--mono:ui-monospace,SFMono-Regular,Menlo,Consolas,"DejaVu Sans Mono",monospace}
*{box-sizing:border-box}
body{margin:0;background:var(--bg);color:var(--fg);font:15px/1.45 system-ui,-apple-system,"Segoe UI",Roboto,
"Helvetica Neue",Arial,"DejaVu Sans",sans-serif}
main{max-width:1120px;margin:0 auto;padding:20px 24px 40px}
h1{font-size:1.45rem;margin:0 0 .4rem}h2{font-size:1.15rem;margin:1.8rem 0 .6rem;padding-bottom:.25rem;
border-bottom:1px solid var(--line)}h3{font-size:1rem;margin:1.1rem 0 .4rem}
code,pre{font-family:var(--mono);font-size:.88em}
code{background:var(--soft);border-radius:3px;padding:0 .25em;overflow-wrap:anywhere}
.muted{color:var(--muted)}.small{font-size:.88em;margin-top:.15rem}
.headline{border:1px solid var(--line);border-left:6px solid var(--red);border-radius:6px;padding:14px 18px;
background:#fffafa}
.headline:has(.status-clean){border-left-color:var(--green);background:#f8fcf8}
.headline:has(.status-recovered){border-left-color:var(--amber);background:#fffcf5}
.summary{font-size:1.05rem;margin:.3rem 0 .7rem}
.facts{color:var(--muted);margin:.6rem 0 0}
.badge{display:inline-block;font-size:.8rem;vertical-align:middle;padding:.15em .55em;border-radius:999px;
color:#fff;background:var(--red);text-transform:uppercase;letter-spacing:.04em}
.badge.status-clean{background:var(--green)}.badge.status-recovered{background:var(--amber)}
.big{font-size:1.2rem;font-weight:700;color:var(--red)}
.tag{display:inline-block;font-size:.78rem;padding:0 .45em;border-radius:4px;border:1px solid currentColor}
.tag.ok,.tag.recovery{color:var(--green)}.tag.warn,.tag.warning{color:var(--amber)}
.tag.bad,.tag.non-finite{color:var(--red)}
.conf{white-space:nowrap}.bar{display:inline-block;width:90px;height:.6em;background:var(--line);border-radius:3px;
vertical-align:middle;overflow:hidden}.bar span{display:block;height:100%;background:var(--blue)}
table{border-collapse:collapse}
table.kv{margin:.2rem 0}table.kv>tbody>tr>th,table.nested>tbody>tr>th{text-align:left;vertical-align:top;
font-weight:600;padding:.2rem 1rem .2rem 0;white-space:nowrap;color:#39424f}
table.kv>tbody>tr>td,table.nested>tbody>tr>td{padding:.2rem 0;vertical-align:top}
table.nested{font-size:.92em;border-left:2px solid var(--line);margin:.1rem 0 .3rem;padding-left:.5rem}
table.nested>tbody>tr>th{padding-left:.5rem;font-weight:500}
table.data{font-size:.88em;margin:.3rem 0}table.data>*>tr>th,table.data>*>tr>td{border:1px solid var(--line);
padding:.25rem .5rem;text-align:left;vertical-align:top}table.data>thead>tr>th{background:var(--soft)}
.acts{margin-top:.2rem;font-size:.92em}
td.num,.num{font-variant-numeric:tabular-nums}td.bad,.num.bad{color:var(--red);font-weight:700}
.scroll{overflow-x:auto}
.notice{background:#fff8e1;border:1px solid #f3d98b;border-radius:5px;padding:.5rem .8rem}
.plots{display:grid;grid-template-columns:repeat(auto-fill,minmax(440px,1fr));gap:10px 18px}
figure{margin:0}figure.plot-fig{break-inside:avoid;page-break-inside:avoid}
figure.plot-fig figcaption{font-size:.78rem;color:var(--muted);text-align:right;margin-top:-4px}
svg.plot{width:100%;height:auto;display:block}
figure.code{margin:.6rem 0;border:1px solid var(--line);border-radius:6px;overflow:hidden}
figure.code figcaption{background:var(--soft);padding:.3rem .7rem;font-size:.85em;color:var(--muted)}
figure.code pre{margin:0;padding:.4rem 0;overflow-x:auto;line-height:1.5}
.ln{display:block;padding:0 .8rem 0 0;white-space:pre}.ln .no{display:inline-block;width:3.5em;padding-right:.8em;
text-align:right;color:var(--muted);user-select:none}
.ln.hl{background:#ffe3e0;box-shadow:inset 4px 0 0 var(--red);font-weight:600}
ol.chain{list-style:none;padding:0;margin:.3rem 0;display:flex;flex-wrap:wrap;align-items:center;gap:6px}
ol.chain li{border:1px solid var(--line);border-radius:6px;padding:.3rem .6rem;background:var(--soft)}
ol.chain li+li{margin-left:20px;position:relative}
ol.chain li+li::before{content:"\\2192";position:absolute;left:-19px;color:var(--muted)}
ol.chain li.origin{border-color:var(--red);background:#fff5f4}ol.chain li.sink{border-color:var(--blue)}
ol.chain li.gap{border-style:dashed;background:none}
ol.fixes li{margin:.3rem 0}
table.events td{font-size:.95em}tr.ev-recovery{background:#f7fbf7}tr.ev-warning{background:#fffbf2}
ul.info{font-size:.9em}
table.deciding th[scope=row]{font-weight:600;white-space:nowrap}table.deciding td.value{white-space:nowrap}
table.deciding td.meaning{color:var(--muted)}
details.all-evidence{margin:.6rem 0}details.all-evidence>summary{cursor:pointer;color:var(--muted)}
footer{margin-top:2.5rem;padding-top:.6rem;border-top:1px solid var(--line);color:var(--muted);font-size:.82em}
@media print{
 @page{margin:14mm}
 body{font-size:10.5pt;background:#fff;color:#000}main{max-width:none;padding:0}
 .headline,.headline:has(.status-clean),.headline:has(.status-recovered){background:#fff}
 .plots{grid-template-columns:1fr 1fr;gap:4mm}
 h2{break-after:avoid;page-break-after:avoid}
 figure.code,table.nested,tr{break-inside:avoid;page-break-inside:avoid}
 .scroll{overflow:visible}
 figure.code pre,.ln{white-space:pre-wrap}
 .badge,.bar span,.ln.hl{-webkit-print-color-adjust:exact;print-color-adjust:exact}
 a{color:inherit;text-decoration:none}
}
"""
