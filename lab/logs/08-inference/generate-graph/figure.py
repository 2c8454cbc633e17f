W, H = 900, 565
out = []
def rect(x, y, w, h, fill, stroke="#444", sw=1, rx=3, dash=None):
    d = f' stroke-dasharray="{dash}"' if dash else ""
    out.append(f'<rect x="{x:.1f}" y="{y}" width="{w:.1f}" height="{h}" rx="{rx}" fill="{fill}" stroke="{stroke}" stroke-width="{sw}"{d}/>')
def text(x, y, s, size=12, anchor="start", fill="#222", bold=False, italic=False):
    s = s.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")
    out.append(f'<text x="{x:.1f}" y="{y}" font-family="sans-serif" font-size="{size}" text-anchor="{anchor}" fill="{fill}" font-weight="{"bold" if bold else "normal"}" font-style="{"italic" if italic else "normal"}">{s}</text>')
def line(x1, y1, x2, y2, color="#444", sw=1, arrow=False, dash=None):
    a = ' marker-end="url(#arrow)"' if arrow else ""
    d = f' stroke-dasharray="{dash}"' if dash else ""
    out.append(f'<line x1="{x1:.1f}" y1="{y1}" x2="{x2:.1f}" y2="{y2}" stroke="{color}" stroke-width="{sw}"{a}{d}/>')

title = "A generation step on the GPU: launched kernel by kernel, or replayed as one graph"
label = ("One step of GPT-2 small's shape for one sequence, over time: by launches the CPU queues 111 "
         "kernels and products one by one and the GPU, done with each in a few microseconds, waits for "
         "the next; as a graph the CPU writes the position, the token and the cache's lengths to memory and launches the "
         "step once, and the GPU runs its kernels back to back")
text(20, 30, title, 18, bold=True)
text(20, 50, "GPT-2 small's shape, one sequence, one token: 12 layers of 9 launches, with the embedding, the last LayerNorm and the logits, 111 in all", 12, fill="#555")

X0, X1 = 150, 880
kinds = ["emb"] + ["ln", "qkv", "kv", "att", "proj", "ln", "fc", "gelu", "out"] * 2
colors = {"emb": "#e6e6e6", "ln": "#e6e6e6", "qkv": "#dbe8f6", "kv": "#fde2c4", "att": "#f6c28b",
          "proj": "#dbe8f6", "fc": "#dbe8f6", "gelu": "#e6e6e6", "out": "#dbe8f6"}

# panel 1: launches
text(20, 86, "Kernel by kernel: the CPU queues every launch, the split chosen for the cache's length", 14, bold=True)
text(20, 122, "CPU", 13, bold=True); text(20, 137, "launches", 11, fill="#555")
text(20, 182, "GPU", 13, bold=True); text(20, 197, "runs", 11, fill="#555")
lw, kw, gap = 13.0, 9.0, 3.0   # launch box, kernel box
x = X0
for i, k in enumerate(kinds[:19]):
    rect(x, 108, lw, 30, "#f3f3f3", rx=2, sw=0.8)
    # the kernel starts once its launch has reached the GPU
    kx = x + lw + 12
    rect(kx, 168, kw, 30, colors[k], rx=2, sw=0.8)
    if i < 3:
        line(x + lw / 2, 138, kx + kw / 2, 166, "#888", 0.8, arrow=True)
    x += lw + gap + 18
    if x > X1 - 60:
        break
text(x + 4, 127, "… 111", 12, fill="#555")
text(x + 4, 187, "… 111", 12, fill="#555")
text(X0, 224, "the GPU idles between kernels: a token's kernel takes microseconds, about what its launch costs the CPU", 12, fill="#555", italic=True)
lx = X0
for fill, what in [("#dbe8f6", "a product (cuBLAS)"), ("#fde2c4", "append_kv"), ("#f6c28b", "flash_decode"), ("#e6e6e6", "embedding, LayerNorm, GELU")]:
    rect(lx, 233, 10, 12, fill, rx=1, sw=0.8); text(lx + 15, 243, what, 11, fill="#555"); lx += 30 + 6.2 * len(what)

# panel 2: the graph
text(20, 290, "As one graph: captured once, replayed every step with the same arguments", 14, bold=True)
text(20, 326, "CPU", 13, bold=True); text(20, 341, "launches", 11, fill="#555")
text(20, 386, "GPU", 13, bold=True); text(20, 401, "runs", 11, fill="#555")
rect(X0, 312, 62, 30, "#fde2c4", rx=2, sw=0.8); text(X0 + 31, 331, "copies", 11, anchor="middle")
rect(X0 + 66, 312, 70, 30, "#f3f3f3", rx=2, sw=0.8); text(X0 + 101, 331, "launch graph", 11, anchor="middle")
line(X0 + 101, 342, X0 + 150, 370, "#888", 0.8, arrow=True)
x = X0 + 150
for k in kinds:
    rect(x, 372, kw, 30, colors[k], rx=2, sw=0.8)
    x += kw + 1.2
text(x + 6, 391, "… 111, back to back", 12, fill="#555")
xe = x + 130
rect(X1 - 150, 312, 120, 30, "#f3f3f3", rx=2, sw=0.8); text(X1 - 90, 331, "read the logits", 11, anchor="middle")
line(xe, 387, X1 - 90, 344, "#888", 0.8, arrow=True, dash="3 3")

# what changes from step to step
rect(20, 440, 860, 118, "#fafafa", "#bbb", rx=4)
text(36, 462, "Nothing that changes may be an argument: a replay gives every kernel the arguments it had when captured", 13, bold=True)
rect(36, 476, 150, 46, "#fde2c4", rx=3); text(111, 495, "at = [len, token]", 12, anchor="middle"); text(111, 512, "written before each step", 11, anchor="middle", fill="#555")
line(186, 490, 250, 482, arrow=True)
text(256, 486, "embed_token: the token's row of wte and the row len − 1 of wpe", 12)
text(256, 516, "append_kv and flash_decode: where k and v go, the keys to read", 12)
line(736, 512, 690, 512, arrow=True)
text(742, 508, "lens, page table", 12, bold=True); text(742, 524, "copied by reserve", 11, fill="#555")
text(36, 546, "and the split is a full cache's, fixed: splits past the cache's end find no keys and weigh nothing in the merge", 11.5, fill="#555")

svg = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{W}" height="{H+10}" viewBox="0 0 {W} {H+10}" role="img" aria-label="{label}">',
       f'<title>{title}</title>',
       '<defs><marker id="arrow" viewBox="0 0 10 10" refX="9" refY="5" markerWidth="7" markerHeight="7" orient="auto-start-reverse"><path d="M 0 0 L 10 5 L 0 10 z" fill="#444"/></marker></defs>',
       f'<rect x="0" y="0" width="{W}" height="{H+10}" rx="0" fill="#fff" stroke="none" stroke-width="0"/>'] + out + ['</svg>']
open('decode-step-graph.svg', 'w').write("\n".join(svg) + "\n")
