/* gradscope viewer (MIT, part of gradscope): pan/zoom, search, drill-down into boxes, minimap, findings.
   Hand-written and dependency-free; scoped to one .gs-view root so several views can share a notebook page.
   The zoom state of a scene is a centre (cx, cy, in SVG units) and a scale k (screen px per SVG unit);
   apply() turns it into the <svg>'s viewBox. */
(function(root){
  if(!root||root.dataset.gsReady)return; root.dataset.gsReady="1";
  var data=JSON.parse(root.querySelector("script.gs-data").textContent);
  var q=function(sel){return root.querySelector(sel);};
  var canvas=q(".gs-canvas"),details=q(".gs-details"),crumbs=q(".gs-crumbs"),input=q(".gs-search"),
      count=q(".gs-count"),note=q(".gs-note"),mini=q(".gs-mini"),miniSvg=mini.querySelector("svg"),
      miniUse=mini.querySelector("use"),vp=mini.querySelector(".gs-vp");
  var scenes=data.scenes,cur=null,ix=data.index,names=ix.names,rowOf={},READABLE=12;
  var lower=names.map(function(x){return x.toLowerCase();});
  ix.nodes.forEach(function(r){if(!(r[0] in rowOf))rowOf[r[0]]=r;});
  root.querySelectorAll(".gs-scene").forEach(function(div,i){
    var s=scenes[div.dataset.scene],svg=div.querySelector("svg");if(!s||!svg)return;
    var vb=svg.viewBox.baseVal;s.div=div;s.svg=svg;s.home={x:vb.x,y:vb.y,w:vb.width||1,h:vb.height||1};
    svg.removeAttribute("width");svg.removeAttribute("height");svg.setAttribute("preserveAspectRatio","xMidYMid meet");
    s.byId={};s.stubs={};s.k=null;
    svg.querySelectorAll("g[id]").forEach(function(g){s.byId[g.id]=g;var m=/^(.*)~\d+$/.exec(g.id);
      if(m)(s.stubs[m[1]]=s.stubs[m[1]]||[]).push(g);});
    var g0=svg.querySelector("g.graph");if(g0){g0.id=root.id+"-g"+i;s.gref=g0.id;}
    var t=svg.querySelector("g.node text");s.font=t?parseFloat(t.getAttribute("font-size"))||10:10;});

  // -- zoom and pan ---------------------------------------------------------------------------------------
  function size(){return {w:canvas.clientWidth||1,h:canvas.clientHeight||1};}
  function fitK(s){var c=size();return Math.min(c.w/s.home.w,c.h/s.home.h)*0.98;}
  function apply(){var s=cur,c=size(),w=c.w/s.k,h=c.h/s.k,x=s.cx-w/2,y=s.cy-h/2;
    s.svg.setAttribute("viewBox",x+" "+y+" "+w+" "+h);s.svg.setAttribute("data-gs-scale",s.k.toFixed(4));
    vp.setAttribute("x",x);vp.setAttribute("y",y);vp.setAttribute("width",w);vp.setAttribute("height",h);
    if(!mapSet){var f=fitK(s);mini.hidden=s.k<=f*1.05&&f>=0.6;}}   // the map when it tells something
  function fit(){var s=cur;s.k=fitK(s);s.cx=s.home.x+s.home.w/2;s.cy=s.home.y+s.home.h/2;apply();}
  function zoomBy(f,px,py){var s=cur,c=size();if(px===undefined){px=c.w/2;py=c.h/2;}
    var ux=s.cx+(px-c.w/2)/s.k,uy=s.cy+(py-c.h/2)/s.k,k=Math.max(fitK(s)/4,Math.min(s.k*f,40));
    s.cx=ux-(px-c.w/2)/k;s.cy=uy-(py-c.h/2)/k;s.k=k;apply();}
  function pan(dx,dy){cur.cx+=dx/cur.k;cur.cy+=dy/cur.k;apply();}
  function centreOn(el,readable){var s=cur,c=size(),r=el.getBoundingClientRect(),cr=canvas.getBoundingClientRect();
    s.cx+=(r.left+r.width/2-cr.left-c.w/2)/s.k;s.cy+=(r.top+r.height/2-cr.top-c.h/2)/s.k;
    if(readable){var t=el.querySelector("text"),fs=t?parseFloat(t.getAttribute("font-size"))||s.font:s.font;
      s.k=Math.max(s.k,READABLE/fs);}
    apply();}
  canvas.addEventListener("wheel",function(e){e.preventDefault();var cr=canvas.getBoundingClientRect();
    zoomBy(e.deltaY>0?1/1.2:1.2,e.clientX-cr.left,e.clientY-cr.top);},{passive:false});
  var drag=null,moved=false;
  canvas.addEventListener("mousedown",function(e){if(e.button!==0||mini.contains(e.target))return;
    drag={x:e.clientX,y:e.clientY,cx:cur.cx,cy:cur.cy};moved=false;root.focus({preventScroll:true});});
  window.addEventListener("mousemove",function(e){if(!drag)return;var dx=e.clientX-drag.x,dy=e.clientY-drag.y;
    if(Math.abs(dx)+Math.abs(dy)>4)moved=true;cur.cx=drag.cx-dx/cur.k;cur.cy=drag.cy-dy/cur.k;apply();});
  window.addEventListener("mouseup",function(){drag=null;});
  window.addEventListener("resize",function(){if(cur)apply();});

  // -- minimap --------------------------------------------------------------------------------------------
  function sizeMini(s){var k=Math.min(200/s.home.w,150/s.home.h);
    mini.style.width=Math.max(24,s.home.w*k)+"px";mini.style.height=Math.max(24,s.home.h*k)+"px";
    miniSvg.setAttribute("viewBox",[s.home.x,s.home.y,s.home.w,s.home.h].join(" "));
    miniUse.setAttribute("href","#"+s.gref);}
  var miniDrag=false,mapSet=false;   // the map shows itself when the drawing is bigger than the pane
  function miniMove(e){var r=miniSvg.getBoundingClientRect();
    cur.cx=cur.home.x+(e.clientX-r.left)/r.width*cur.home.w;cur.cy=cur.home.y+(e.clientY-r.top)/r.height*cur.home.h;apply();}
  mini.addEventListener("mousedown",function(e){e.stopPropagation();e.preventDefault();miniDrag=true;miniMove(e);});
  window.addEventListener("mousemove",function(e){if(miniDrag)miniMove(e);});
  window.addEventListener("mouseup",function(){miniDrag=false;});

  // -- scenes (drill-down) and breadcrumbs ----------------------------------------------------------------
  function open(sid){var s=scenes[sid];if(!s||!s.svg)return false;
    if(cur===s)return true;
    if(cur)cur.div.hidden=true;cur=s;s.div.hidden=false;root.dataset.scene=sid;
    if(s.k===null)fit();else apply();
    sizeMini(s);note.textContent=s.note||"";crumbs.textContent="";
    var chain=[],x=sid;while(x){chain.unshift(x);x=scenes[x].parent;}
    chain.forEach(function(id,j){if(j)crumbs.appendChild(document.createTextNode(" \u203a "));
      var last=j===chain.length-1,el=document.createElement(last?"b":"a");el.textContent=scenes[id].title;
      el.setAttribute("data-scene",id);if(!last)el.addEventListener("click",function(){open(id);});
      crumbs.appendChild(el);});
    markMatches();return true;}
  function elsFor(s,id){if(s.byId[id])return [s.byId[id]];return s.stubs[id]||[];}
  // where a node is drawn: the deepest pre-rendered scene and the element standing for it there
  function locate(r){var p=ix.paths[r[3]],sid="top",j=0;
    while(j<p.length&&scenes[p[j]]&&scenes[p[j]].svg&&(j<p.length-1||r[4])){sid=p[j];j++;}
    return {sid:sid,eid:j<p.length?p[j]:r[0]};}
  function inScene(r,sid){var p=ix.paths[r[3]],i=sid==="top"?0:p.indexOf(sid)+1;
    if(sid!=="top"&&i===0)return [];
    if(i<p.length)return elsFor(scenes[sid],p[i]);
    return r[4]?elsFor(scenes[sid],r[0]):[];}

  // -- details, highlight ---------------------------------------------------------------------------------
  function show(id){var d=(cur.elements||{})[id];if(!d){details.textContent="";return;}
    var t=[(d.kind||"")+": "+(d.name||"")];
    if(d.module&&d.module!==d.name)t.push("module: "+d.module);
    if(d.shape)t.push("shape: "+d.shape+" "+(d.dtype||""));
    if(d.ops!==undefined)t.push(d.ops+" ops, "+d.members+" nodes");
    if(d.pattern&&d.pattern.length)t.push("pattern: "+d.pattern.join(", "));
    if(d.bytes)t.push("saved: "+d.bytes);
    (d.saved||[]).forEach(function(x){t.push("  "+x);});
    var ps=d.params||[];if(ps.length)t.push("parameters:");
    ps.slice(0,8).forEach(function(x){t.push("  "+x);});if(ps.length>8)t.push("  ... "+(ps.length-8)+" more");
    if(d.location)t.push("at "+d.location);
    if(d.worst)t.push("worst finding: "+d.worst);
    if(scenes[id]&&scenes[id].svg)t.push("(click to open this box; Esc goes back)");
    else if(d.closed)t.push(d.closed);
    details.textContent=t.join("\n");}
  function clear(cls){cur.svg.querySelectorAll("g."+cls).forEach(function(g){g.classList.remove(cls);
    if(cls==="gs-hl")g.removeAttribute("data-gs-highlight");});}
  function highlight(els){clear("gs-hl");els.forEach(function(g){g.classList.add("gs-hl");g.setAttribute("data-gs-highlight","1");});}
  canvas.addEventListener("mouseover",function(e){var g=e.target.closest&&e.target.closest("g.node");
    if(g&&cur.svg.contains(g))show(g.id);});
  canvas.addEventListener("click",function(e){if(moved)return;var g=e.target.closest&&e.target.closest("g.node");
    if(!g||!cur.svg.contains(g))return;
    if(scenes[g.id]&&scenes[g.id].svg){show(g.id);open(g.id);return;}
    if(g.classList.contains("gs-context")&&rowOf[g.id]){goTo(rowOf[g.id],"gs-hl");return;}   // a stub: go there
    highlight([g]);show(g.id);});

  // -- search ---------------------------------------------------------------------------------------------
  var matches=[],mi=-1,timer=null,searched="";
  function markMatches(){clear("gs-match");clear("gs-cur");var n=0;
    for(var i=0;i<matches.length&&n<5000;i++){inScene(matches[i],cur.div.dataset.scene).forEach(function(g){
      g.classList.add("gs-match");n++;});}}
  function runSearch(){var text=input.value.trim().toLowerCase();matches=[];mi=-1;searched=text;
    if(text){var hit=lower.map(function(x){return x.indexOf(text)>=0;}),byName=[],byModule=[];
      ix.nodes.forEach(function(r){if(hit[r[1]]||r[0].toLowerCase()===text)byName.push(r);else if(hit[r[2]])byModule.push(r);});
      matches=byName.concat(byModule);}
    markMatches();
    count.textContent=text?(matches.length?matches.length+" match"+(matches.length>1?"es":"")+" (Enter)":"no match"):"";
    root.dataset.matches=matches.length;}
  function goTo(r,cls){var loc=locate(r);open(loc.sid);var els=elsFor(cur,loc.eid);
    if(cls==="gs-hl")highlight(els);else{clear(cls);els.forEach(function(g){g.classList.add(cls);});}
    if(els[0]){centreOn(els[0],true);show(els[0].id);}return loc;}
  function step(d){if(timer){clearTimeout(timer);timer=null;}
    if(input.value.trim().toLowerCase()!==searched)runSearch();
    if(!matches.length)return;mi=(mi+d+matches.length)%matches.length;
    var r=matches[mi],loc=goTo(r,"gs-cur");
    var box=loc.eid!==r[0]&&(cur.elements||{})[loc.eid];
    count.textContent=(mi+1)+" / "+matches.length+": "+names[r[1]]+(box?" (inside "+box.name+")":"");}
  input.addEventListener("input",function(){if(timer)clearTimeout(timer);
    timer=setTimeout(function(){timer=null;runSearch();},ix.nodes.length>3000?200:60);});

  // -- findings -------------------------------------------------------------------------------------------
  root.querySelectorAll(".gs-findings li").forEach(function(li){li.addEventListener("click",function(){
    root.querySelectorAll(".gs-findings li").forEach(function(x){x.classList.remove("gs-active");});
    li.classList.add("gs-active");
    var f=data.findings[+li.dataset.index],row=f.node!==null&&rowOf[f.node],sid=row?locate(row).sid:"top";
    open(sid);var els=[];
    (f.nodes||[]).forEach(function(n){if(rowOf[n])els=els.concat(inScene(rowOf[n],sid));});
    if(sid==="top")(f.targets||[]).forEach(function(id){els=els.concat(elsFor(cur,id));});
    els=els.filter(function(g,i){return els.indexOf(g)===i;});highlight(els);
    var main=(row&&inScene(row,sid)[0])||els[0];
    if(main){centreOn(main,true);show(main.id);}else details.textContent=f.message+"\n(not drawn on the graph)";});});

  // -- keys: + - 0 zoom, arrows pan, / search, Esc back; in the search box Enter/arrows step ---------------
  function onKey(e){
    if(e.target===input){var k0=e.key;
      if(k0==="Enter"||k0==="ArrowDown"||k0==="ArrowUp"){step(k0==="ArrowUp"||e.shiftKey?-1:1);e.preventDefault();}
      else if(k0==="Escape"){input.value="";runSearch();root.focus();e.preventDefault();}
      e.stopPropagation();return;}
    if(e.ctrlKey||e.metaKey||e.altKey||(e.target&&/^(INPUT|TEXTAREA|SELECT)$/.test(e.target.tagName)))return;
    var k=e.key,done=true,c=size();
    if(k==="+"||k==="=")zoomBy(1.25);else if(k==="-"||k==="_")zoomBy(0.8);else if(k==="0")fit();
    else if(k==="ArrowLeft")pan(-c.w/5,0);else if(k==="ArrowRight")pan(c.w/5,0);
    else if(k==="ArrowUp")pan(0,-c.h/5);else if(k==="ArrowDown")pan(0,c.h/5);
    else if(k==="/"||k==="f"){input.focus();input.select();}
    else if(k==="n"||k==="N")step(k==="N"?-1:1);
    else if(k==="Escape"||k==="Backspace"){if(cur.parent)open(cur.parent);}
    else if(k==="m"){mini.hidden=!mini.hidden;mapSet=true;}
    else done=false;
    if(done){e.preventDefault();e.stopPropagation();}}
  root.addEventListener("keydown",onKey);
  if(root.dataset.page)document.addEventListener("keydown",function(e){
    var a=document.activeElement;if(!a||a===document.body||a===document.documentElement)onKey(e);});
  root.querySelectorAll(".gs-bar button").forEach(function(b){b.addEventListener("click",function(){
    var a=b.dataset.act;if(a==="in")zoomBy(1.4);else if(a==="out")zoomBy(1/1.4);else if(a==="fit")fit();
    else if(a==="next"||a==="prev")step(a==="next"?1:-1);else if(a==="map"){mini.hidden=!mini.hidden;mapSet=true;}});});

  // -- start: the notebook pane takes the drawing's height (text at its natural size when it fits) ---------
  if(root.dataset.autoHeight){var top=scenes.top,cw=canvas.clientWidth||800,bar=q(".gs-bar").offsetHeight||30;
    var k=Math.min(cw/top.home.w,4/3),side=q(".gs-side").scrollHeight||0,
        h=Math.max(top.home.h*k+bar+4,side+2),most=Math.max(420,0.85*(window.innerHeight||900));
    root.style.height=Math.round(Math.max(320,Math.min(h,most)))+"px";}
  open("top");
  if(root.dataset.page)root.focus({preventScroll:true});
})(function(){var s=document.currentScript,p=s&&s.parentElement;   // the view this script sits in
  return p&&p.classList.contains("gs-view")?p:document.getElementById("__ROOT__");}());
