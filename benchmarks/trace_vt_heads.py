"""Which heads retrieve vt items, and do the same heads select the right trace definition? (trace diagnosis)

    PYTHONPATH=src OMP_NUM_THREADS=1 python benchmarks/trace_vt_heads.py runs/teacher-68c180d

For 12 eval-split vt prompts (length 1024) it teacher-forces the answer (the chain's names) and prints, per layer, the
three heads with the most attention mass from the query (the token before each answer name) onto all vt items
(``var NAME = ...``), with the mass on the item that defines the name being written. Compare with the per-head
trace numbers of ``trace_lookup_diag.py`` (``docs/notes/trace_diagnosis.md``).
"""
import sys

import torch
from transformers import AutoModelForCausalLM
from kvlearn.testbed import tasks
from kvlearn.testbed.tokenizer import WORD_TO_ID
torch.set_num_threads(1)
path=sys.argv[1]
model=AutoModelForCausalLM.from_pretrained(path, attn_implementation="eager").eval()
VAR,EQ=WORD_TO_ID["var"],WORD_TO_ID["="]
tot=torch.zeros(8,8); right=torch.zeros(8,8); n=0; acc=[]
for i in range(12):
    e=tasks.generate("vt", tasks.example_seed("vt","eval",i), 1024)
    p=e.prompt_ids; ids=torch.tensor([p+e.answer_ids])
    with torch.no_grad(): out=model(input_ids=ids, output_attentions=True)
    items=[s for s in range(len(p)-2) if p[s]==VAR and p[s+2]==EQ]
    where={p[s+1]:s for s in items}
    P=len(p)
    for j,t in enumerate(e.answer_ids[:-1]):
        q=P+j-1
        acc.append(int(out.logits[0,q].argmax())==t)
        for l,a in enumerate(out.attentions):
            row=a[0,:,q,:]
            tot[l]+=sum(row[:,s:s+6].sum(-1) for s in items)
            s=where[t]; right[l]+=row[:,s:s+6].sum(-1)
        n+=1
print("vt acc", sum(acc)/len(acc))
T=tot/n; R=right/n
for l in range(8):
    top=sorted(range(8), key=lambda h:-float(T[l,h]))[:3]
    print(l, [(h, round(float(T[l,h]),2), round(float(R[l,h]),2)) for h in top])
