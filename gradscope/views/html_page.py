"""The interactive view: inline SVG with pan/zoom, the findings list, node details. No network, no CDN.

:func:`widget` is one self-contained fragment (used by the notebook display); :func:`page` wraps it in a
full HTML document (``report.render("graph.html")``). The script finds elements by the ``id`` attributes
that :mod:`gradscope.views.dot` puts on every drawn element; a highlighted element gets the class ``gs-hl``
and the attribute ``data-gs-highlight="1"``.
"""

from __future__ import annotations

import html
import itertools
import json

__all__ = ["page", "widget", "findings_table", "svg_text"]

_COUNTER = itertools.count()

CSS = """
.gs-view{display:flex;font:13px/1.4 system-ui,-apple-system,Segoe UI,Helvetica,Arial,sans-serif;color:#0f172a;
  border:1px solid #e2e8f0;border-radius:6px;overflow:hidden;background:#fff}
.gs-side{width:340px;min-width:240px;overflow:auto;border-right:1px solid #e2e8f0;padding:8px 10px;box-sizing:border-box}
.gs-canvas{flex:1;position:relative;overflow:hidden;cursor:grab;background:#fcfcfd}
.gs-canvas svg{width:100%;height:100%;display:block;user-select:none}
.gs-canvas .gs-tools{position:absolute;right:8px;top:8px;display:flex;gap:4px}
.gs-tools button{border:1px solid #cbd5e1;background:#fff;border-radius:4px;padding:1px 8px;cursor:pointer}
.gs-findings{list-style:none;margin:0;padding:0}
.gs-findings li{padding:6px;margin:0 0 6px;border-radius:4px;border-left:4px solid #94a3b8;background:#f8fafc;cursor:pointer}
.gs-findings li.gs-error{border-left-color:#dc2626}.gs-findings li.gs-warning{border-left-color:#d97706}
.gs-findings li.gs-active{background:#fef9c3}
.gs-kind{font-weight:600;font-family:ui-monospace,Menlo,monospace}
.gs-details{margin-top:10px;padding:6px;background:#f1f5f9;border-radius:4px;white-space:pre-wrap;
  font-family:ui-monospace,Menlo,monospace;font-size:12px;min-height:2em}
.gs-view g.node{cursor:pointer}
.gs-view g.gs-hl>path,.gs-view g.gs-hl>polygon,.gs-view g.gs-hl>ellipse{stroke:#facc15!important;stroke-width:7px!important}
.gs-table{border-collapse:collapse;margin:0 0 8px;font:13px system-ui,sans-serif}
.gs-table td,.gs-table th{border:1px solid #e2e8f0;padding:3px 8px;text-align:left;vertical-align:top}
"""

# Small, hand-written: pan (drag), zoom (wheel, buttons), highlight + centre on finding click, details
# on node hover/click. Scoped to one container so several views can live on one notebook page.
JS = r"""
(function(root){
  if(!root||root.dataset.gsReady)return; root.dataset.gsReady="1";
  var data=JSON.parse(root.querySelector("script.gs-data").textContent);
  var svg=root.querySelector(".gs-canvas svg"), details=root.querySelector(".gs-details");
  if(!svg)return;
  var vb=svg.viewBox.baseVal, home={x:vb.x,y:vb.y,w:vb.width,h:vb.height}, box={x:vb.x,y:vb.y,w:vb.width,h:vb.height};
  svg.removeAttribute("width");svg.removeAttribute("height");
  function apply(){svg.setAttribute("viewBox",box.x+" "+box.y+" "+box.w+" "+box.h);}
  function toSvg(cx,cy){var p=svg.createSVGPoint();p.x=cx;p.y=cy;return p.matrixTransform(svg.getScreenCTM().inverse());}
  function zoom(k,cx,cy){var p=toSvg(cx,cy);box.x=p.x-(p.x-box.x)*k;box.y=p.y-(p.y-box.y)*k;box.w*=k;box.h*=k;apply();}
  svg.addEventListener("wheel",function(e){e.preventDefault();zoom(e.deltaY>0?1.2:1/1.2,e.clientX,e.clientY);},{passive:false});
  var drag=null;
  svg.addEventListener("mousedown",function(e){drag={p:toSvg(e.clientX,e.clientY)};});
  window.addEventListener("mousemove",function(e){if(!drag)return;var p=toSvg(e.clientX,e.clientY);
    box.x-=p.x-drag.p.x;box.y-=p.y-drag.p.y;apply();});
  window.addEventListener("mouseup",function(){drag=null;});
  function byId(id){var all=svg.querySelectorAll("g[id]");for(var i=0;i<all.length;i++){if(all[i].id===id)return all[i];}return null;}
  function centre(el){var r=el.getBoundingClientRect(),c=toSvg(r.left+r.width/2,r.top+r.height/2);
    var k=Math.min(1,Math.max(home.w,home.h)>2000?0.25:1);box.w=home.w*k;box.h=home.h*k;
    box.x=c.x-box.w/2;box.y=c.y-box.h/2;apply();}
  function show(id){var d=data.elements[id];if(!d){details.textContent="";return;}
    var t=[(d.kind||"")+": "+(d.name||"")];
    if(d.module)t.push("module: "+d.module);
    if(d.shape)t.push("shape: "+d.shape+" "+(d.dtype||""));
    if(d.ops!==undefined)t.push(d.ops+" ops, "+d.members+" nodes");
    if(d.pattern&&d.pattern.length)t.push("pattern: "+d.pattern.join(", "));
    if(d.bytes)t.push("saved: "+d.bytes);
    (d.saved||[]).forEach(function(s){t.push("  "+s);});
    (d.params||[]).forEach(function(s){t.push("  "+s);});
    if(d.location)t.push("at "+d.location);
    if(d.worst)t.push("worst finding: "+d.worst);
    details.textContent=t.join("\n");}
  function highlight(ids){svg.querySelectorAll(".gs-hl").forEach(function(g){g.classList.remove("gs-hl");g.removeAttribute("data-gs-highlight");});
    var first=null;ids.forEach(function(id){var g=byId(id);if(g){g.classList.add("gs-hl");g.setAttribute("data-gs-highlight","1");first=first||g;}});
    return first;}
  svg.querySelectorAll("g.node").forEach(function(g){
    g.addEventListener("mouseenter",function(){show(g.id);});
    g.addEventListener("click",function(){highlight([g.id]);show(g.id);});});
  root.querySelectorAll(".gs-findings li").forEach(function(li){
    li.addEventListener("click",function(){
      root.querySelectorAll(".gs-findings li").forEach(function(x){x.classList.remove("gs-active");});
      li.classList.add("gs-active");
      var f=data.findings[+li.dataset.index],el=highlight(f.targets);
      if(el){centre(el);show(el.id);}else{details.textContent=f.message+"\n(not drawn on the graph)";}});});
  root.querySelectorAll(".gs-tools button").forEach(function(b){b.addEventListener("click",function(){
    var r=svg.getBoundingClientRect(),cx=r.left+r.width/2,cy=r.top+r.height/2;
    if(b.dataset.act==="in")zoom(1/1.4,cx,cy);else if(b.dataset.act==="out")zoom(1.4,cx,cy);
    else{box={x:home.x,y:home.y,w:home.w,h:home.h};apply();}});});
})(document.getElementById("__ROOT__"));
"""


def svg_text(svg_bytes: bytes) -> str:
    """The ``<svg>`` element of dot's SVG output (XML prolog, doctype and comments dropped)."""
    text = svg_bytes.decode("utf-8")
    return text[text.index("<svg"):]


def _findings_data(report, drawing) -> list[dict]:
    out = []
    for f, targets in zip(report.findings, drawing.targets):
        out.append({"kind": f.kind, "severity": f.severity, "message": f.message, "location": f.location,
                    "params": list(f.params), "node": f.node, "targets": targets})
    return out


def findings_table(report) -> str:
    """An HTML table of the findings (or a one-line 'no findings' note)."""
    from gradscope._format import human_bytes

    head = (f"<p><b>gradscope</b>: {report.graph.number_of_nodes()} nodes, "
            f"{html.escape(human_bytes(report.saved_bytes))} saved for backward, "
            f"{len(report.findings)} finding{'s' if len(report.findings) != 1 else ''}</p>")
    if not report.findings:
        return head
    rows = "".join(
        f"<tr><td>{html.escape(f.severity)}</td><td><code>{html.escape(f.kind)}</code></td>"
        f"<td>{html.escape(f.message)}</td><td>{html.escape(f.location or '')}</td></tr>"
        for f in report.findings)
    return (head + '<table class="gs-table"><tr><th>severity</th><th>kind</th><th>message</th>'
            f"<th>where</th></tr>{rows}</table>")


def widget(report, drawing, svg: str, *, height: str = "100%", side: bool = True) -> str:
    """The pan/zoom view as one HTML fragment: a ``<div class="gs-view">`` with its style and script."""
    root = f"gs-view-{next(_COUNTER)}"
    data = {"elements": drawing.elements, "findings": _findings_data(report, drawing)}
    blob = json.dumps(data, default=str, sort_keys=True).replace("</", "<\\/")
    items = "".join(
        f'<li class="gs-{html.escape(f.severity)}" data-index="{i}" id="gs-finding-{i}">'
        f'<span class="gs-kind">{html.escape(f.kind)}</span> ({html.escape(f.severity)})'
        f'{" at " + html.escape(f.location) if f.location else ""}<br>{html.escape(f.message)}</li>'
        for i, f in enumerate(report.findings))
    panel = (f'<div class="gs-side"><b>Findings</b><ol class="gs-findings">{items}</ol>'
             + ("" if report.findings else "<p>No findings.</p>")
             + '<b>Details</b> <small>(hover or click a node)</small><div class="gs-details"></div></div>')
    tools = ('<div class="gs-tools"><button data-act="in" title="zoom in">+</button>'
             '<button data-act="out" title="zoom out">&minus;</button>'
             '<button data-act="home" title="fit">fit</button></div>')
    return (f'<div class="gs-view" id="{root}" style="height:{height}"><style>{CSS}</style>'
            f'{panel if side else ""}<div class="gs-canvas">{svg}{tools}</div>'
            f'<script type="application/json" class="gs-data">{blob}</script>'
            f'<script>{JS.replace("__ROOT__", root)}</script></div>')


def page(report, **kwargs) -> str:
    """A complete, self-contained HTML page of ``report`` (see :func:`gradscope.views.render.render`)."""
    from gradscope.views.drawing import draw_report, pipe

    drawing = draw_report(report, **kwargs)
    svg = svg_text(pipe(drawing.dot, "svg"))
    title = f"gradscope: {report.graph.number_of_nodes()} nodes, {len(report.findings)} findings"
    return ("<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">"
            f"<title>{html.escape(title)}</title>"
            "<style>html,body{margin:0;height:100%}body{padding:8px;box-sizing:border-box}</style></head>"
            f"<body>{widget(report, drawing, svg, height='calc(100vh - 16px)')}</body></html>\n")
