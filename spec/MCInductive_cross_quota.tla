---- MODULE MCInductive_cross_quota ----
\* The cross-rank inductive check of DGAPInductive (CrossInv: IndInv and Align) on a bounded domain, quota mode, M = 2.
\* Two ranks; rank 0 owns samples 0 and 1, rank 1 owns sample 2; loss tokens one below the cost.
EXTENDS DGAPInductive

MCShard == [x \in 0 .. 1 |-> <<{0, 1}, {2}>>[x + 1]]
MCSampleLen == [x \in 0 .. 2 |-> <<1, 3, 2>>[x + 1]]
MCSampleLoss == [x \in 0 .. 2 |-> <<0, 2, 1>>[x + 1]]
MCSamplePatches == [x \in 0 .. 2 |-> 0]
MCPlan == <<>>
MCCarried == {}

====
