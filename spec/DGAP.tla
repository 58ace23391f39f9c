-------------------------------- MODULE DGAP --------------------------------
(***************************************************************************)
(* DGAP: the Distributed Group Alignment Protocol of odb-core, one epoch.   *)
(*                                                                         *)
(* W ranks each read their own shard of samples.  A rank observes samples  *)
(* into a window of K, forms batches under a token budget with the         *)
(* sort-window greedy former, and offers at most M of them to a round's    *)
(* all-gather.  Every rank reduces the gathered vectors with the same      *)
(* decision (Decide): how many aligned steps the round runs and whether    *)
(* the epoch closes.  A rank with no real batch for a step runs a pad step.*)
(*                                                                         *)
(* A sample has a cost (its tokens, which the budget bounds) and loss      *)
(* tokens (labels not masked, which normalise the loss); the vector        *)
(* carries both per offered batch.  Every rank folds the decided steps     *)
(* into optimizer (gradient-accumulation) windows, closed by global counts *)
(* only: after AccumSteps steps, or at the first step at which the         *)
(* window's global loss tokens reach TokensPerUpdate, or with the epoch.   *)
(*                                                                         *)
(* Variables and actions mirror odb_core name for name: the per-rank       *)
(* variables are the fields of protocol.RankSnapshot, the others those of  *)
(* model.GlobalState; the actions are model.Action names.  The Python      *)
(* model's reachable state graph equals this spec's on small constants     *)
(* (odb_core/verify/conformance.py), and recorded runs are replayed through it *)
(* (Trace modules built by odb_core/verify/tlc/).                         *)
(*                                                                         *)
(* Dynamic sharding (Dynamic = TRUE, odb_core/assign.py): no rank owns a   *)
(* shard; each starts with an initial share of the Plan and every round's  *)
(* Deal, computed by every rank from the same gathered vectors, says how   *)
(* many of the next plan ids each rank loads (proofs/dynamic_sharding.md). *)
(* With AnyPlacement the deal's count is split by any placement, agreed    *)
(* by all ranks at AllGather (placement): an adversarial pricing.  With    *)
(* AnyInitialSplit the ranks start on any agreed split of the initial      *)
(* prefix's ids (InitialSplits): an adversarial placement of the initial   *)
(* shares.                                                                 *)
(*                                                                         *)
(* A batch is the set of its sample ids: the order inside a batch and its  *)
(* oversize flag are functions of that set.  Oversized samples follow the  *)
(* `solo` policy (a batch of its own); with every sample within budget,    *)
(* which the model configs of this repository use, `error` is the same.    *)
(***************************************************************************)
EXTENDS Naturals, Sequences, FiniteSets

CONSTANTS
    W,              \* world size; ranks are 0 .. W-1
    Shard,          \* Shard[r]: the ids rank r's source yields this epoch
    SampleLen,      \* SampleLen[i]: text + visual tokens of sample i; ids = DOMAIN
    SampleLoss,     \* SampleLoss[i]: tokens of sample i whose loss counts (Sample.loss)
    SamplePatches,  \* SamplePatches[i]: visual patches of sample i
    Budget,         \* token budget of one batch (integral)
    MaxSamples,     \* cap on samples per batch, 0 = none
    MaxPatches,     \* cap on patches per batch, 0 = none
    CostModel,      \* "packed" (sum of lengths) or "padded" (n * max length)
    K,              \* window (buffer) size per rank
    M,              \* max steps agreed per round
    Mode,           \* "join" or "quota"
    Quota,          \* global sample quota in quota mode, 0 = none
    Deterministic,  \* TRUE: a source yields its samples in id order
    AccumSteps,     \* steps per optimizer window (grad_accum_steps; 1 when unset)
    TokensPerUpdate,\* close a window at TokensPerUpdate global loss tokens; 0 = by steps
    Dynamic,        \* TRUE: dynamic sharding (Sharding.DYNAMIC): ranks are dealt the Plan
    Plan,           \* the epoch's plan, a sequence of all ids (<<>> with static sharding)
    Target,         \* dynamic sharding: the configured target (DealTarget bounds it)
    Carried,        \* quota mode: ids this pass took over from the last one's ledger
    EarlyForm,      \* least partial window a rank may form early (FormEarly); 0 = never
    AnyPlacement,   \* dynamic sharding: a round's deal is split by any placement (Pricing)
    AnyInitialSplit,\* dynamic sharding: Init starts the ranks on any agreed initial split
    NoValue         \* model value: no contribution / empty inbox

Ranks == 0 .. W - 1
Ids == DOMAIN SampleLen
Phases == {"filling", "waiting", "done"}

ASSUME
    /\ W \in Nat \ {0}
    /\ K \in Nat \ {0}
    /\ M \in Nat \ {0}
    /\ Shard \in [Ranks -> SUBSET Ids]
    /\ \A r, s \in Ranks : r # s => Shard[r] \cap Shard[s] = {}
    /\ UNION {Shard[r] : r \in Ranks} = Ids
    /\ SamplePatches \in [Ids -> Nat]
    /\ SampleLoss \in [Ids -> Nat]
    /\ AccumSteps \in Nat \ {0}
    /\ TokensPerUpdate \in Nat
    /\ TokensPerUpdate > 0 => AccumSteps = 1
    /\ Budget \in Nat /\ MaxSamples \in Nat /\ MaxPatches \in Nat /\ Quota \in Nat
    /\ CostModel \in {"packed", "padded"}
    /\ Mode \in {"join", "quota"}
    /\ Mode = "join" => Quota = 0
    /\ Deterministic \in BOOLEAN
    /\ Dynamic \in BOOLEAN /\ Target \in Nat
    /\ Plan \in Seq(Ids)
    /\ Dynamic => /\ Target > 0 /\ Len(Plan) = Cardinality(Ids)
                  /\ {Plan[p] : p \in DOMAIN Plan} = Ids
    /\ ~Dynamic => Plan = <<>>
    /\ Carried \subseteq Ids /\ (Mode = "join" => Carried = {})
    /\ EarlyForm \in Nat
    /\ EarlyForm > 0 => EarlyForm < K /\ Mode = "join" /\ ~Dynamic
    /\ AnyPlacement \in BOOLEAN /\ (AnyPlacement => Dynamic)
    /\ AnyInitialSplit \in BOOLEAN /\ (AnyInitialSplit => Dynamic)

VARIABLES
    phase,          \* per rank: "filling" | "waiting" | "done"
    exhausted,      \* per rank: the source was found dry
    buffer,         \* per rank: the window, a set of ids
    ready,          \* per rank: formed batches not yet emitted, a sequence of id sets
    steps,          \* per rank: aligned steps run (real and pad)
    pads,           \* per rank: pad steps run
    round,          \* per rank: collectives completed
    emitted,        \* per rank: global real samples emitted so far (its view)
    contribution,   \* per rank: the vector it put into the open round, or NoValue
    window_loss,    \* per rank: global loss tokens of the open optimizer window so far
    window_local,   \* per rank: its own loss tokens in the open window so far
    windows,        \* per rank: closed windows, a sequence of [end, loss, local]
    pending,        \* per rank: ids its source has not yielded yet (dynamic sharding:
                    \* the ids dealt to it and not yet observed, RankSnapshot.queue)
    cursor,         \* per rank: plan positions dealt so far (dynamic sharding; else 0)
    formed,         \* per rank: a starved rank formed its window since it last changed
    inbox,          \* per rank: the gathered round it has not consumed, or NoValue
    delivered,      \* per id: how many times it was emitted in a real batch
    ledger,         \* ids carried to the next epoch by a quota-mode close
    step_batches,   \* per rank: the batch run at each of its steps, {} for a pad
    step_counts,    \* per rank: <<global samples, cost tokens, loss tokens>> of each
                    \* step it ran, as it decided them from the gathered vectors
    placement       \* AnyPlacement: the split of the gathered round's deal every rank
                    \* loads its slice of, agreed at AllGather; NoValue when no round
                    \* is in flight (always NoValue without AnyPlacement)

rankVars == <<phase, exhausted, buffer, ready, steps, pads, round, emitted, contribution,
             window_loss, window_local, windows, cursor, formed>>
vars == <<rankVars, pending, inbox, delivered, ledger, step_batches, step_counts, placement>>

-----------------------------------------------------------------------------
(* Arithmetic helpers (TLC 2.15 ships no CommunityModules).                *)

RECURSIVE SumOver(_, _)
SumOver(S, f) ==
    IF S = {} THEN 0
    ELSE LET x == CHOOSE x \in S : TRUE IN f[x] + SumOver(S \ {x}, f)

SumSeq(s) == SumOver(DOMAIN s, s)
MinOf(S) == CHOOSE x \in S : \A y \in S : x <= y
MaxOf(S) == CHOOSE x \in S : \A y \in S : y <= x
Min2(a, b) == IF a <= b THEN a ELSE b
Max2(a, b) == IF a >= b THEN a ELSE b

-----------------------------------------------------------------------------
(* Cost models and the sort-window greedy former (formers.py).             *)

Tokens(B) == SumOver(B, SampleLen)
LossTokens(B) == SumOver(B, SampleLoss)

Cost(B) ==
    IF CostModel = "padded"
    THEN IF B = {} THEN 0 ELSE Cardinality(B) * MaxOf({SampleLen[i] : i \in B})
    ELSE Tokens(B)

Fits(B) ==
    /\ Cost(B) <= Budget
    /\ MaxSamples = 0 \/ Cardinality(B) <= MaxSamples
    /\ MaxPatches = 0 \/ SumOver(B, SamplePatches) <= MaxPatches

\* Longest first, ties by the smaller id: the order never depends on arrivals.
Before(i, j) == SampleLen[i] > SampleLen[j] \/ (SampleLen[i] = SampleLen[j] /\ i <= j)

RECURSIVE LongestFirst(_)
LongestFirst(S) ==
    IF S = {} THEN <<>>
    ELSE LET h == CHOOSE i \in S : \A j \in S : Before(i, j)
         IN <<h>> \o LongestFirst(S \ {h})

\* Fold over the sorted window: a batch is closed when the next sample would
\* overflow it; a sample that does not fit alone gets a batch of its own.
RECURSIVE Greedy(_, _, _)
Greedy(seq, open, closed) ==
    IF seq = <<>> THEN [closed |-> closed, open |-> open]
    ELSE LET s == Head(seq)
         IN IF open = {} \/ Fits(open \cup {s})
            THEN Greedy(Tail(seq), open \cup {s}, closed)
            ELSE Greedy(Tail(seq), {s}, Append(closed, open))

\* Without flush the last, open batch goes back to the window to meet later
\* arrivals, unless it is the only batch: a full window always progresses.
Split(g, flush) ==
    IF g.open = {} THEN [batches |-> g.closed, leftovers |-> {}]
    ELSE IF flush \/ g.closed = <<>>
         THEN [batches |-> Append(g.closed, g.open), leftovers |-> {}]
         ELSE [batches |-> g.closed, leftovers |-> g.open]

\* (Values used twice are passed as operator arguments, which TLC evaluates
\* once; it re-evaluates LET definitions under ENABLED, i.e. for fairness.)
FormResult(S, flush) == Split(Greedy(LongestFirst(S), {}, <<>>), flush)

\* A batch of one sample that does not fit alone (Batch.oversize).
Oversized(B) == Cardinality(B) = 1 /\ ~Fits(B)

\* First fit of the fresh samples (longest first) into the carried batches.
RECURSIVE TopUp(_, _, _)
TopUp(bins, seq, rest) ==
    IF seq = <<>> THEN [bins |-> bins, rest |-> rest]
    ELSE LET s == Head(seq)
             fit == {j \in DOMAIN bins : ~Oversized(bins[j]) /\ Fits(bins[j] \cup {s})}
         IN IF fit = {} THEN TopUp(bins, Tail(seq), rest \cup {s})
            ELSE TopUp([bins EXCEPT ![MinOf(fit)] = @ \cup {s}], Tail(seq), rest)

AfterTopUp(f, flush) ==
    IF f.rest = {} THEN [batches |-> f.bins, leftovers |-> {}]
    ELSE LET tail == FormResult(f.rest, flush)
         IN [batches |-> f.bins \o tail.batches, leftovers |-> tail.leftovers]

\* formers.carried_first: once fresh samples share the window with carried
\* ones, the carried samples are formed first (alone, flushed), the fresh ones
\* top up those batches where they fit, and the rest is formed as usual; so
\* every batch holding a carried id precedes every batch without one
\* (proofs/cross_epoch_fairness.md).  Without a carried id: FormResult.
CarriedFirst(S, flush) ==
    IF S \cap Carried = {} \/ S \subseteq Carried THEN FormResult(S, flush)
    ELSE AfterTopUp(TopUp(FormResult(S \cap Carried, TRUE).batches,
                          LongestFirst(S \ Carried), {}), flush)

-----------------------------------------------------------------------------
(* Dynamic sharding (odb_core/assign.py, proofs/dynamic_sharding.md).       *)
(* Plan positions are 0-based as in Python: position p is Plan[p + 1].     *)

\* The ids at plan positions [a, b).
PlanIds(a, b) == {Plan[p] : p \in a + 1 .. b}
\* Plan position of id i.
Pos(i) == CHOOSE p \in 0 .. Len(Plan) - 1 : Plan[p + 1] = i
\* The first id of S in plan order (dynamic deterministic mode reads in plan order).
PlanFirst(S) == CHOOSE i \in S : \A j \in S : Pos(i) <= Pos(j)

\* assign.deal_target: what the deal tops each rank up to, the configured Target
\* bounded by the half split Len(Plan) \div 2W and never under half of Target.
DealTarget == Min2(Target, Max2(Len(Plan) \div (2 * W), (Target + 1) \div 2))

\* assign.initial_share / initial_slice / initial_cursor (with ProtocolConfig.target,
\* i.e. DealTarget; the same share as with Target)
InitialShare == Max2(1, Min2(DealTarget, Len(Plan) \div (2 * W)))
InitialSlice(r) ==
    PlanIds(Min2(r * InitialShare, Len(Plan)), Min2((r + 1) * InitialShare, Len(Plan)))
InitialCursor == IF Dynamic THEN Min2(W * InitialShare, Len(Plan)) ELSE 0
\* Priced initial shares (cost_table.placed, issue 32): a learned table places the
\* prefix [0, c) (assign.priced_shares: each id to the rank of least priced work so
\* far) and reorders it so that every rank's share is one run of the plan; c is
\* assign.initial_cursor (priced or not): the whole plan when a rank's share of it
\* fits the configured target (W * Target >= Len(Plan)). Safety uses only that every
\* rank computes the same shares from agreed state (proofs/dynamic_sharding.md,
\* "Pricing"), so with AnyInitialSplit Init picks any c of InitialCursors and any
\* split of InitialSplits(c): a rank f[i] for every id i of the prefix, rank r
\* starting on ShareOf(f, r) with cursor c. Any placement of the prefix is one of
\* them, and so is any cut of it into consecutive slices (the unpriced start).
\* (The Python placement gives each rank an id when c >= W; these splits need not.)
InitialCursors ==
    {InitialCursor, IF W * Target >= Len(Plan) THEN Len(Plan) ELSE InitialCursor}
InitialSplits(c) == [PlanIds(0, c) -> Ranks]
ShareOf(f, r) == {i \in DOMAIN f : f[i] = r}

\* RankMachine.starved: nothing dealt is left unread, but the plan is not dealt out.
Starved(r) == Dynamic /\ pending[r] = {} /\ cursor[r] < Len(Plan)

\* The ranks lowest first by estimate, ties to the lower rank (a heap of (est, r)).
RECURSIVE DealLoop(_, _, _, _)
DealLoop(out, est, unit, n) ==
    IF n = 0 THEN out
    ELSE LET r == CHOOSE r \in Ranks :
                    \A q \in Ranks : est[r] < est[q] \/ (est[r] = est[q] /\ r <= q)
         IN DealLoop([out EXCEPT ![r] = @ + 1], [est EXCEPT ![r] = @ + unit], unit, n - 1)

\* assign.deal_cap: a round that runs steps deals at most half of the plan left
\* (rounded up) while more than two ids a rank are left (factoring).
DealCap(k, planLeft) ==
    IF k > 0 /\ planLeft > 2 * W THEN (planLeft + 1) \div 2 ELSE planLeft

\* assign.deal: how many of the next plan ids each rank loads, from the gathered
\* vectors g, the round's k steps and the planLeft ids not dealt yet, of which
\* it deals at most DealCap(k, planLeft) (DealUpTo below).  A rank
\* that offered nothing and is not final gets one first; then the ranks lack
\* DealTarget - count each, dealt one at a time to the least estimated held work
\* (its known costs plus its unread ids priced at the gathered mean cost).
DealUpTo(g, k, planLeft) ==
    LET Later(r) == Min2(k, g[r].offered) + 1 .. g[r].offered
        HeldN(r) == g[r].held + SumOver(Later(r), g[r].samples)
        Count(r) == HeldN(r) + g[r].unread
        Work(r) == g[r].held_work + SumOver(Later(r), g[r].tokens)
        Hungry(r) == g[r].offered = 0 /\ ~g[r].final
        out0 == [r \in Ranks |->
                    IF Hungry(r) /\ Cardinality({q \in 0 .. r - 1 : Hungry(q)}) < planLeft
                    THEN 1 ELSE 0]
        left == planLeft - SumOver(Ranks, out0)
        want == SumOver(Ranks, [r \in Ranks |-> Max2(0, DealTarget - Count(r) - out0[r])])
        hn == SumOver(Ranks, [r \in Ranks |-> HeldN(r)])
        hw == SumOver(Ranks, [r \in Ranks |-> Work(r)])
        plain == hn = 0 \/ hw = 0
    IN IF Min2(left, want) <= 0 THEN out0
       ELSE DealLoop(out0,
                     [r \in Ranks |-> IF plain THEN Count(r) + out0[r]
                                      ELSE Work(r) * hn + (g[r].unread + out0[r]) * hw],
                     IF plain THEN 1 ELSE hw, Min2(left, want))
Deal(g, k, planLeft) == DealUpTo(g, k, DealCap(k, planLeft))
\* Placement (issue 32): how the deal's count is split between the ranks may be
\* any function of the agreed state (the gathered vectors, the plan, the cursor,
\* a learned cost table every rank holds: assign.deal's Pricing).  NoLoss,
\* NoDuplicate, IdentityCoverage and the bounds use only that every rank computes
\* the same split of a count decided from the gathered vectors alone
\* (proofs/dynamic_sharding.md, "Pricing"); Deal above is the mean-priced split.
\* With AnyPlacement the spec checks exactly that: AllGather picks, once per
\* gathered round, any split of Deal's count (Placements(DealTotal(g))), an
\* adversarial pricing that every rank agrees on, and every rank loads its
\* slice of that split (placement) instead of Deal's.  A split need not give a
\* starved rank its first id: D2 needs only that the round deals one.

\* What rank r loads of deal a: its slice follows the lower ranks' slices.
SliceStart(r, a) == cursor[r] + SumOver({q \in Ranks : q < r}, a)
NoDeal == [r \in Ranks |-> 0]
\* Every split of n ids between the ranks (every placement a pricing can choose).
Placements(n) == {a \in [Ranks -> 0 .. n] : SumOver(Ranks, a) = n}
\* The deal rank r reads from the gathered round d was decided on (none when
\* static or when the round closes the epoch): Deal's split, or the agreed one.
DealOf(r, d) == IF Dynamic /\ ~d.done
                THEN IF AnyPlacement THEN placement
                     ELSE Deal(inbox[r], d.steps, Len(Plan) - cursor[r])
                ELSE NoDeal

-----------------------------------------------------------------------------
(* The collective: what each rank offers and what every rank decides.      *)

\* protocol.RankMachine._make_contribution; dynamic sharding adds what the rank
\* holds beyond the offered batches: unread dealt ids, held samples and their cost.
Offer(r) ==
    LET n == Min2(Len(ready[r]), M)
        later == n + 1 .. Len(ready[r])
    IN [offered |-> n,
        final   |-> exhausted[r] /\ buffer[r] = {} /\ Len(ready[r]) <= M,
        samples |-> [t \in 1 .. n |-> Cardinality(ready[r][t])],
        tokens  |-> [t \in 1 .. n |-> Tokens(ready[r][t])],
        loss_tokens |-> [t \in 1 .. n |-> LossTokens(ready[r][t])],
        unread |-> IF Dynamic THEN Cardinality(pending[r]) ELSE 0,
        held |-> IF Dynamic
                 THEN Cardinality(buffer[r])
                      + SumOver(later, [t \in later |-> Cardinality(ready[r][t])])
                 ELSE 0,
        held_work |-> IF Dynamic
                      THEN Tokens(buffer[r]) + SumOver(later, [t \in later |-> Tokens(ready[r][t])])
                      ELSE 0]

CutAt(k, gs, gt, gl, done) ==
    [steps |-> k, done |-> done,
     global_samples |-> SubSeq(gs, 1, k), global_tokens |-> SubSeq(gt, 1, k),
     global_loss_tokens |-> SubSeq(gl, 1, k)]

\* The exact-step quota cut on the round's global sample counts gs (the cost
\* and loss token columns gt, gl are cut with them).
QuotaCut(gs, gt, gl, done0, before) ==
    LET hits == IF Mode = "quota" /\ Quota > 0
                THEN {t \in DOMAIN gs : before + SumSeq(SubSeq(gs, 1, t)) >= Quota}
                ELSE {}
    IN CutAt(IF hits = {} THEN Len(gs) ELSE MinOf(hits), gs, gt, gl, done0 \/ hits # {})

\* protocol.decide_round, on the gathered vectors g and emitted-so-far `before`.
\* join:  k = min offered over ranks that are not final, else max offered and
\*        the epoch ends.  quota: k = min offered over all ranks, the epoch ends
\*        when a final rank offered exactly k, or at the exact step the global
\*        sample count reaches the quota.
Decide(g, before) ==
    LET open == {r \in Ranks : ~g[r].final}
        k0 == IF Mode = "join"
              THEN IF open # {} THEN MinOf({g[r].offered : r \in open})
                   ELSE MaxOf({g[r].offered : r \in Ranks})
              ELSE MinOf({g[r].offered : r \in Ranks})
        done0 == IF Mode = "join" THEN open = {}
                 ELSE \E r \in Ranks : g[r].final /\ g[r].offered = k0
        Column(t, field) ==
            LET S == {r \in Ranks : t <= g[r].offered}
            IN SumOver(S, [r \in S |-> g[r][field][t]])
    IN QuotaCut([t \in 1 .. k0 |-> Column(t, "samples")],
                [t \in 1 .. k0 |-> Column(t, "tokens")],
                [t \in 1 .. k0 |-> Column(t, "loss_tokens")], done0, before)

-----------------------------------------------------------------------------
(* Optimizer windows (RankMachine._emit, _window_closes, _close_window).    *)
(* A rank's window state w: its step count, the open window's global and    *)
(* local loss tokens, the closed windows.  The closing rule reads only the  *)
(* step count and global counts, which every rank has from the same         *)
(* all-gather; the local count is only recorded.                            *)

WindowState(r) ==
    [steps |-> steps[r], loss |-> window_loss[r], local |-> window_local[r],
     windows |-> windows[r]]

LastEnd(ws) == IF ws = <<>> THEN 0 ELSE ws[Len(ws)].end

\* Steps decided in the open window (RankMachine.window_steps).
WindowSteps(w) == w.steps - LastEnd(w.windows)

\* Whether the open window closes at the step just added.
WindowCloses(w) ==
    IF TokensPerUpdate > 0 THEN w.loss >= TokensPerUpdate
    ELSE WindowSteps(w) >= AccumSteps

CloseWindow(w) ==
    [steps |-> w.steps, loss |-> 0, local |-> 0,
     windows |-> Append(w.windows, [end |-> w.steps, loss |-> w.loss, local |-> w.local])]

\* One decided step: gl global loss tokens, `local` of them this rank's (0 on
\* a pad); `last`: the epoch's last step, which closes the window too.
AddStep(w, gl, local) == [w EXCEPT !.steps = @ + 1, !.loss = @ + gl, !.local = @ + local]
StepWindow(w, last) == IF WindowCloses(w) \/ last THEN CloseWindow(w) ELSE w

\* Steps t .. d.steps of decision d, in order; locals[t]: this rank's loss tokens.
RECURSIVE FoldSteps(_, _, _, _)
FoldSteps(w, d, locals, t) ==
    IF t > d.steps THEN w
    ELSE FoldSteps(StepWindow(AddStep(w, d.global_loss_tokens[t], locals[t]),
                              d.done /\ t = d.steps),
                   d, locals, t + 1)

\* A closing round without a step closes a window left open.
CloseAtEnd(w, done) == IF done /\ WindowSteps(w) > 0 THEN CloseWindow(w) ELSE w

\* This rank's loss tokens at each of the n decided steps: its first `real`
\* queued batches, then pads.
StepLocals(r, n, real) == [t \in 1 .. n |-> IF t <= real THEN LossTokens(ready[r][t]) ELSE 0]

\* Rank r's window state after it runs decision d with `real` real batches.
EmitWindows(r, d, real) ==
    CloseAtEnd(FoldSteps(WindowState(r), d, StepLocals(r, d.steps, real), 1), d.done)

\* The batches rank r runs at the n decided steps: its first `real` queued
\* batches, then pads ({}); and the decided steps' global counts.
RunBatches(r, n, real) == [t \in 1 .. n |-> IF t <= real THEN ready[r][t] ELSE {}]
StepCounts(d) ==
    [t \in 1 .. d.steps |->
        <<d.global_samples[t], d.global_tokens[t], d.global_loss_tokens[t]>>]

-----------------------------------------------------------------------------
(* Which local action a rank may take (RankMachine.enabled).                *)

NeedsSample(r) ==
    \/ /\ phase[r] = "waiting"          \* prefetch while the collective runs
       /\ ~exhausted[r] /\ ~Starved(r) /\ Cardinality(buffer[r]) < K
    \/ /\ phase[r] = "filling" /\ ready[r] = <<>>
       /\ ~exhausted[r] /\ ~Starved(r) /\ Cardinality(buffer[r]) < K

\* A starved rank forms its window once (until it observes again).
CanForm(r) ==
    /\ phase[r] = "filling" /\ ready[r] = <<>>
    /\ \/ Cardinality(buffer[r]) >= K
       \/ exhausted[r] /\ buffer[r] # {}
       \/ Starved(r) /\ buffer[r] # {} /\ ~formed[r]

\* A dry rank with nothing left, or a starved one with what it could form.
CanContribute(r) ==
    /\ phase[r] = "filling"
    /\ \/ ready[r] # <<>>
       \/ exhausted[r] /\ buffer[r] = {}
       \/ Starved(r) /\ Cardinality(buffer[r]) < K /\ (buffer[r] = {} \/ formed[r])

-----------------------------------------------------------------------------
(* Actions.                                                                 *)

\* The initial state with the ranks' sources p and cursors c.
InitWith(p, c) ==
    /\ phase = [r \in Ranks |-> "filling"]
    /\ exhausted = [r \in Ranks |-> FALSE]
    /\ buffer = [r \in Ranks |-> {}]
    /\ ready = [r \in Ranks |-> <<>>]
    /\ steps = [r \in Ranks |-> 0]
    /\ pads = [r \in Ranks |-> 0]
    /\ round = [r \in Ranks |-> 0]
    /\ emitted = [r \in Ranks |-> 0]
    /\ contribution = [r \in Ranks |-> NoValue]
    /\ window_loss = [r \in Ranks |-> 0]
    /\ window_local = [r \in Ranks |-> 0]
    /\ windows = [r \in Ranks |-> <<>>]
    /\ pending = p
    /\ cursor = c
    /\ formed = [r \in Ranks |-> FALSE]
    /\ inbox = [r \in Ranks |-> NoValue]
    /\ delivered = [i \in Ids |-> 0]
    /\ ledger = {}
    /\ step_batches = [r \in Ranks |-> <<>>]
    /\ step_counts = [r \in Ranks |-> <<>>]
    /\ placement = NoValue

\* With AnyInitialSplit the ranks start on any agreed split of the initial prefix.
Init ==
    IF AnyInitialSplit
    THEN \E c \in InitialCursors : \E f \in InitialSplits(c) :
            InitWith([r \in Ranks |-> ShareOf(f, r)], [r \in Ranks |-> c])
    ELSE InitWith(IF Dynamic THEN [r \in Ranks |-> InitialSlice(r)] ELSE Shard,
                  [r \in Ranks |-> InitialCursor])

\* Sample i arrives from rank r's source (in id order when Deterministic; in
\* plan order with dynamic sharding).
Observe(r, i) ==
    /\ NeedsSample(r)
    /\ i \in pending[r]
    /\ Deterministic => i = IF Dynamic THEN PlanFirst(pending[r]) ELSE MinOf(pending[r])
    /\ buffer' = [buffer EXCEPT ![r] = @ \cup {i}]
    /\ pending' = [pending EXCEPT ![r] = @ \ {i}]
    /\ formed' = [formed EXCEPT ![r] = FALSE]
    /\ UNCHANGED <<phase, exhausted, ready, steps, pads, round, emitted, contribution,
                   window_loss, window_local, windows, inbox, delivered, ledger,
                   step_batches, step_counts, cursor, placement>>

\* Rank r's source is found dry.
Exhaust(r) ==
    /\ NeedsSample(r)
    /\ pending[r] = {}
    /\ exhausted' = [exhausted EXCEPT ![r] = TRUE]
    /\ UNCHANGED <<phase, buffer, ready, steps, pads, round, emitted, contribution,
                   window_loss, window_local, windows, pending, inbox, delivered, ledger,
                   step_batches, step_counts, cursor, formed, placement>>

\* A starved rank keeps its open batch back: the next deal may fill it.  When
\* the window formed a single batch, that batch is the open one.
HoldBack(res) ==
    IF res.batches # <<>> /\ res.leftovers = {}
    THEN [batches |-> SubSeq(res.batches, 1, Len(res.batches) - 1),
          leftovers |-> res.batches[Len(res.batches)]]
    ELSE res

\* An early form (RankMachine.form_early): a rank with nothing ready and a
\* partial window of at least EarlyForm samples may, instead of waiting for its
\* next sample, form the window without flush and emit only its fullest batch
\* (formers.fullest_batch: most tokens, the first on a tie); the rest waits for
\* later arrivals.  Nothing is emitted when the window is one batch.  Once per
\* observation (formed).  Whenever it is enabled, so is NeedsSample.
CanFormEarly(r) ==
    /\ EarlyForm > 0
    /\ phase[r] = "filling" /\ ready[r] = <<>>
    /\ ~exhausted[r] /\ ~Starved(r) /\ ~formed[r]
    /\ EarlyForm <= Cardinality(buffer[r]) /\ Cardinality(buffer[r]) < K

FullestIndex(bs) ==
    CHOOSE j \in DOMAIN bs :
        \A i \in DOMAIN bs :
            \/ Tokens(bs[i]) < Tokens(bs[j])
            \/ Tokens(bs[i]) = Tokens(bs[j]) /\ j <= i

FormEarly(r) ==
    /\ CanFormEarly(r)
    /\ \E res \in {CarriedFirst(buffer[r], FALSE)} :
         IF Len(res.batches) <= 1 /\ res.leftovers = {}
         THEN UNCHANGED <<ready, buffer>>
         ELSE \E b \in {res.batches[FullestIndex(res.batches)]} :
                /\ ready' = [ready EXCEPT ![r] = <<b>>]
                /\ buffer' = [buffer EXCEPT ![r] = @ \ b]
    /\ formed' = [formed EXCEPT ![r] = TRUE]
    /\ UNCHANGED <<phase, exhausted, steps, pads, round, emitted, contribution,
                   window_loss, window_local, windows, pending, inbox, delivered, ledger,
                   step_batches, step_counts, cursor, placement>>

\* Run the former on the window: a full window, the tail of a dry source, or
\* the window of a starved rank (formed without flush, once).
Form(r) ==
    /\ CanForm(r)
    /\ \E short \in {Starved(r) /\ Cardinality(buffer[r]) < K} :
       /\ \E res \in {IF short THEN HoldBack(CarriedFirst(buffer[r], FALSE))
                      ELSE CarriedFirst(buffer[r], Cardinality(buffer[r]) < K)} :
             /\ ready' = [ready EXCEPT ![r] = @ \o res.batches]
             /\ buffer' = [buffer EXCEPT ![r] = res.leftovers]
       /\ formed' = [formed EXCEPT ![r] = @ \/ short]
    /\ UNCHANGED <<phase, exhausted, steps, pads, round, emitted, contribution,
                   window_loss, window_local, windows, pending, inbox, delivered, ledger,
                   step_batches, step_counts, cursor, placement>>

\* Enter the round's all-gather with this rank's vector.
Contribute(r) ==
    /\ CanContribute(r)
    /\ contribution' = [contribution EXCEPT ![r] = Offer(r)]
    /\ phase' = [phase EXCEPT ![r] = "waiting"]
    /\ UNCHANGED <<exhausted, buffer, ready, steps, pads, round, emitted,
                   window_loss, window_local, windows, pending, inbox, delivered, ledger,
                   step_batches, step_counts, cursor, formed, placement>>

\* With AnyPlacement the round's deal is split by any placement, chosen here once
\* and agreed by every rank: an adversarial pricing.  All ranks consumed the
\* same rounds, so they decide the same deal count (rank 0's view stands for all).
DealTotal(g) ==
    LET d == Decide(g, emitted[0])
    IN IF Dynamic /\ ~d.done
       THEN SumOver(Ranks, Deal(g, d.steps, Len(Plan) - cursor[0]))
       ELSE 0

\* The collective completes once every rank has contributed and consumed the
\* previous round; every rank gets the same gathered vectors (and, with
\* AnyPlacement, the same placement of the round's deal).
AllGather ==
    /\ \A r \in Ranks : phase[r] = "waiting" /\ inbox[r] = NoValue
    /\ inbox' = [r \in Ranks |-> contribution]
    /\ placement' \in IF AnyPlacement THEN Placements(DealTotal(contribution)) ELSE {NoValue}
    /\ UNCHANGED <<rankVars, pending, delivered, ledger, step_batches, step_counts>>

\* The agreed placement is dropped once the last rank has loaded its slice.
PlacementAfter(r) == IF \A q \in Ranks \ {r} : inbox[q] = NoValue THEN NoValue ELSE placement

\* (`\E x \in {e}` binds e once: TLC does not cache LET values when it
\* evaluates ENABLED for the fairness condition, and Decide is not cheap.)
\* Rank r consumes the gathered round: it runs the agreed steps, real batches
\* from the head of its queue and pad steps after them, folding each into its
\* optimizer window, then either starts the next round or closes the epoch,
\* carrying what it still holds to the ledger.  With dynamic sharding it loads
\* its slice of the round's deal (DealOf: Deal's split, or the placement agreed
\* at AllGather), or, at the close, the ids not dealt yet are carried too.
Receive(r) ==
    /\ inbox[r] # NoValue
    /\ \E d \in {Decide(inbox[r], emitted[r])} :
       \E a \in {DealOf(r, d)} :
       LET real == Min2(d.steps, Len(ready[r]))
           rest == SubSeq(ready[r], real + 1, Len(ready[r]))
           carried == buffer[r] \cup UNION {rest[t] : t \in DOMAIN rest}
       IN /\ steps' = [steps EXCEPT ![r] = @ + d.steps]
          /\ pads' = [pads EXCEPT ![r] = @ + (d.steps - real)]
          /\ emitted' = [emitted EXCEPT ![r] = @ + SumSeq(d.global_samples)]
          /\ round' = [round EXCEPT ![r] = @ + 1]
          /\ contribution' = [contribution EXCEPT ![r] = NoValue]
          /\ inbox' = [inbox EXCEPT ![r] = NoValue]
          /\ delivered' = [i \in Ids |->
                delivered[i] + Cardinality({t \in 1 .. real : i \in ready[r][t]})]
          /\ step_batches' = [step_batches EXCEPT ![r] = @ \o RunBatches(r, d.steps, real)]
          /\ step_counts' = [step_counts EXCEPT ![r] = @ \o StepCounts(d)]
          /\ \E w \in {EmitWindows(r, d, real)} :
                /\ window_loss' = [window_loss EXCEPT ![r] = w.loss]
                /\ window_local' = [window_local EXCEPT ![r] = w.local]
                /\ windows' = [windows EXCEPT ![r] = w.windows]
          /\ IF d.done
             THEN /\ phase' = [phase EXCEPT ![r] = "done"]
                  /\ buffer' = [buffer EXCEPT ![r] = {}]
                  /\ ready' = [ready EXCEPT ![r] = <<>>]
                  /\ ledger' = ledger \cup carried \cup pending[r] \cup PlanIds(cursor[r], Len(Plan))
                  /\ pending' = [pending EXCEPT ![r] = {}]
                  /\ UNCHANGED cursor
             ELSE /\ phase' = [phase EXCEPT ![r] = "filling"]
                  /\ ready' = [ready EXCEPT ![r] = rest]
                  /\ pending' = [pending EXCEPT ![r] =
                        @ \cup PlanIds(SliceStart(r, a), SliceStart(r, a) + a[r])]
                  /\ cursor' = [cursor EXCEPT ![r] = @ + SumOver(Ranks, a)]
                  /\ UNCHANGED <<buffer, ledger>>
    /\ placement' = PlacementAfter(r)
    /\ UNCHANGED <<exhausted, formed>>

AllDone == \A r \in Ranks : phase[r] = "done"

\* A finished epoch stutters, so that TLC's deadlock check flags real deadlocks only.
Terminating == AllDone /\ UNCHANGED vars

ProtocolNext ==
    \/ \E r \in Ranks :
        \/ \E i \in Ids : Observe(r, i)
        \/ Exhaust(r)
        \/ Form(r)
        \/ FormEarly(r)
        \/ Contribute(r)
        \/ Receive(r)
    \/ AllGather

Next == ProtocolNext \/ Terminating

\* Weak fairness of the protocol's steps, the source's included (it eventually
\* yields a sample or is found dry): while some step stays enabled, one is
\* taken.  Nothing is assumed of Terminating.  Here this is weaker than weak
\* fairness of each action: a state that enables a protocol step can only
\* stutter, so a behaviour that never takes one keeps every enabled action
\* enabled forever.
Fairness == WF_vars(ProtocolNext)

\* ENABLED <<ProtocolNext>>_vars written out: every guard has a successor that
\* changes some variable (EnabledExact checks it).  TLC evaluates ENABLED of
\* these actions slowly, so the models check LiveSpec, which is Spec with
\* WF unfolded into  []<>~ENABLED <<A>>_v \/ []<><<A>>_v  over this predicate.
ProtocolEnabled ==
    \/ \E r \in Ranks :
        NeedsSample(r) \/ CanForm(r) \/ CanContribute(r) \/ inbox[r] # NoValue
    \/ \A r \in Ranks : phase[r] = "waiting" /\ inbox[r] = NoValue

LiveFairness == []<>(~ProtocolEnabled) \/ []<><<ProtocolNext>>_vars

Spec == Init /\ [][Next]_vars /\ Fairness
LiveSpec == Init /\ [][Next]_vars /\ LiveFairness

-----------------------------------------------------------------------------
(* Invariants, named as in odb_core/verify/invariants.py.                 *)

ContributionType ==
    [offered : 0 .. M, final : BOOLEAN, samples : Seq(Nat), tokens : Seq(Nat),
     loss_tokens : Seq(Nat), unread : Nat, held : Nat, held_work : Nat]

WindowType == [end : Nat, loss : Nat, local : Nat]

TypeOK ==
    /\ phase \in [Ranks -> Phases]
    /\ exhausted \in [Ranks -> BOOLEAN]
    /\ buffer \in [Ranks -> SUBSET Ids]
    /\ ready \in [Ranks -> Seq((SUBSET Ids) \ {{}})]
    /\ steps \in [Ranks -> Nat] /\ pads \in [Ranks -> Nat]
    /\ round \in [Ranks -> Nat] /\ emitted \in [Ranks -> Nat]
    /\ contribution \in [Ranks -> ContributionType \cup {NoValue}]
    /\ window_loss \in [Ranks -> Nat] /\ window_local \in [Ranks -> Nat]
    /\ windows \in [Ranks -> Seq(WindowType)]
    /\ pending \in [Ranks -> SUBSET Ids]
    /\ cursor \in [Ranks -> 0 .. Len(Plan)]
    /\ formed \in [Ranks -> BOOLEAN]
    /\ inbox \in [Ranks -> [Ranks -> ContributionType \cup {NoValue}] \cup {NoValue}]
    /\ delivered \in [Ids -> Nat]
    /\ ledger \subseteq Ids
    /\ step_batches \in [Ranks -> Seq(SUBSET Ids)]
    /\ step_counts \in [Ranks -> Seq(Nat \X Nat \X Nat)]
    /\ placement \in [Ranks -> Nat] \cup {NoValue}
    /\ \A r \in Ranks : Cardinality(buffer[r]) <= K /\ pads[r] <= steps[r]

\* Ranks that completed the same number of rounds ran the same number of steps.
StepAlignment ==
    \A r, s \in Ranks : round[r] = round[s] => steps[r] = steps[s]

\* Ranks are never more than one collective apart.
CollectiveAlignment ==
    \A r, s \in Ranks : round[r] <= round[s] + 1

NoDuplicate == \A i \in Ids : delivered[i] <= 1

\* Every id is in exactly one place: a source, a window, a formed batch,
\* delivered once, or in the ledger.
Places(i) ==
    delivered[i]
    + Cardinality({r \in Ranks : i \in pending[r]})
    + Cardinality({r \in Ranks : i \in buffer[r]})
    + SumOver(Ranks, [r \in Ranks |-> Cardinality({t \in DOMAIN ready[r] : i \in ready[r][t]})])
    + (IF i \in ledger THEN 1 ELSE 0)

\* Dynamic sharding: the plan ids no rank holds yet.  A rank whose inbox holds
\* the gathered round has yet to load its slice of that round's deal; those
\* ids are its own (InboxSlice), the rest of the plan past every deal is
\* undealt (invariants._undealt).
InboxDeal(r) == DealOf(r, Decide(inbox[r], emitted[r]))
InboxSlice(r) ==
    IF ~Dynamic \/ inbox[r] = NoValue THEN {}
    ELSE LET a == InboxDeal(r) IN PlanIds(SliceStart(r, a), SliceStart(r, a) + a[r])
Undealt ==
    LET ends == {cursor[r] : r \in Ranks}
                \cup {cursor[r] + SumOver(Ranks, InboxDeal(r)) : r \in {q \in Ranks : inbox[q] # NoValue}}
    IN PlanIds(MaxOf(ends), Len(Plan))
Unheld(r) == IF ~Dynamic \/ \E q \in Ranks : phase[q] = "done" THEN {} ELSE InboxSlice(r)
UndealtRest == IF ~Dynamic \/ \E q \in Ranks : phase[q] = "done" THEN {} ELSE Undealt

\* \A i \in Ids : Places(i) = 1, counted for all ids at once (linear in the ids,
\* which matters when TLC replays a long recorded trace): the places cover the
\* ids and their sizes add up to the number of ids.
NoLoss ==
    LET D == {i \in Ids : delivered[i] > 0}
        Queued(r) == UNION {ready[r][t] : t \in DOMAIN ready[r]}
        QueuedSize(r) == SumSeq([t \in DOMAIN ready[r] |-> Cardinality(ready[r][t])])
        Held(r) == Cardinality(pending[r]) + Cardinality(buffer[r]) + QueuedSize(r)
                   + Cardinality(Unheld(r))
    IN /\ \A i \in D : delivered[i] = 1
       /\ D \cup ledger \cup UndealtRest
            \cup UNION {pending[r] \cup buffer[r] \cup Queued(r) \cup Unheld(r) : r \in Ranks} = Ids
       /\ Cardinality(D) + Cardinality(ledger) + Cardinality(UndealtRest)
            + SumOver(Ranks, [r \in Ranks |-> Held(r)])
            = Cardinality(Ids)

IdentityCoverage ==
    Mode = "join" =>
        /\ ledger = {}
        /\ AllDone => \A i \in Ids : delivered[i] = 1

\* A closed quota epoch emitted or carried every id once, and ended exactly
\* at its cut: at the step at which the global sample count reached the quota
\* (the count before that step was below it), or when the first rank ran dry.
QuotaClosed ==
    (Mode = "quota" /\ AllDone) =>
        /\ \A i \in Ids : delivered[i] + (IF i \in ledger THEN 1 ELSE 0) = 1
        /\ \/ Quota > 0 /\ Cardinality({i \in Ids : delivered[i] = 1}) >= Quota
           \/ IF Dynamic THEN \E r \in Ranks : exhausted[r]    \* dealt out, and dry
              ELSE \E r \in Ranks : \A i \in Shard[r] : delivered[i] >= 1

QuotaCutExact ==
    (Mode = "quota" /\ AllDone /\ Quota > 0 /\ step_counts[0] # <<>>) =>
        LET n == Len(step_counts[0])
        IN Cardinality({i \in Ids : delivered[i] = 1}) - step_counts[0][n][1] < Quota

QuotaClosure == QuotaClosed /\ QuotaCutExact

\* A batch over budget is a single sample that does not fit alone (`solo`).
BudgetSafety ==
    \A r \in Ranks : \A t \in DOMAIN ready[r] :
        Fits(ready[r][t]) \/ Cardinality(ready[r][t]) = 1

\* Join: every step some rank that never padded runs a real batch.  Quota: no
\* rank ever pads, so every rank runs a real batch at every step
\* (proofs/bounded_termination.md).
\* Dynamic sharding (assign.dynamic_bounds, proofs/dynamic_sharding.md D2): a
\* step per plan id; a round per step or per id dealt after the initial
\* shares, plus the last.
StepsBound ==
    IF Dynamic THEN Len(Plan)
    ELSE IF Mode = "quota" THEN MinOf({Cardinality(Shard[r]) : r \in Ranks})
    ELSE MaxOf({Cardinality(Shard[r]) : r \in Ranks})
RoundsBound ==
    IF Dynamic THEN Len(Plan) + (Len(Plan) - InitialCursor) + 1 ELSE StepsBound + 1

BoundedTermination ==
    \A r \in Ranks : steps[r] <= StepsBound /\ round[r] <= RoundsBound

\* A rank finishes only in a round that closes the epoch for every rank.
TerminationAgreement ==
    \A r, s \in Ranks :
        (phase[r] = "done" /\ phase[s] # "done") =>
            inbox[s] # NoValue /\ round[s] = round[r] - 1

\* The global counts of step t, summed over the batches the ranks ran at it.
StepTotals(t) ==
    <<SumOver(Ranks, [r \in Ranks |-> Cardinality(step_batches[r][t])]),
      SumOver(Ranks, [r \in Ranks |-> Tokens(step_batches[r][t])]),
      SumOver(Ranks, [r \in Ranks |-> LossTokens(step_batches[r][t])])>>

\* While a vector is in flight it describes the head of the rank's queue
\* (samples, cost tokens, loss tokens), and every rank got what each rank
\* sent; so the global counts of a step are the sums of the local ones: every
\* rank decided the same counts for each step, they add up over the ranks'
\* batches of that step, and a rank's emitted count is their sum.
OfferExact ==
    \A r \in Ranks :
        /\ contribution[r] # NoValue =>
            LET c == contribution[r]
            IN /\ c.offered <= Len(ready[r])
               /\ \A t \in 1 .. c.offered :
                    /\ c.samples[t] = Cardinality(ready[r][t])
                    /\ c.tokens[t] = Tokens(ready[r][t])
                    /\ c.loss_tokens[t] = LossTokens(ready[r][t])
        /\ inbox[r] # NoValue => inbox[r][r] = contribution[r]

StepCountsExact ==
    /\ \A r \in Ranks :
        /\ Len(step_counts[r]) = Len(step_batches[r])
        /\ SumOver(DOMAIN step_counts[r], [t \in DOMAIN step_counts[r] |-> step_counts[r][t][1]])
            = emitted[r]
    /\ \A r, s \in Ranks : \A t \in DOMAIN step_counts[r] \cap DOMAIN step_counts[s] :
        step_counts[r][t] = step_counts[s][t]
    /\ \A t \in 1 .. MinOf({Len(step_batches[r]) : r \in Ranks}) :
        step_counts[0][t] = StepTotals(t)

ExactLossScaling == OfferExact /\ StepCountsExact

\* Ranks that completed the same rounds closed the same optimizer windows at
\* the same steps with the same global loss tokens, and hold the same open
\* window; each window closed by its rule (the last one of an epoch may be
\* short); and when all ranks completed the same rounds, each window's local
\* loss tokens add up over the ranks to its global count (so the window's
\* loss scales sum to exactly the global per-token mean).
WindowView(r) ==
    <<[i \in DOMAIN windows[r] |-> <<windows[r][i].end, windows[r][i].loss>>], window_loss[r]>>

WindowStart(r, i) == IF i = 1 THEN 0 ELSE windows[r][i - 1].end

WindowAlignment ==
    /\ \A r, s \in Ranks : round[r] = round[s] => WindowView(r) = WindowView(s)
    /\ \A r \in Ranks : \A i \in DOMAIN windows[r] :
        /\ windows[r][i].end > WindowStart(r, i)
        /\ \/ i = Len(windows[r]) /\ phase[r] = "done"
           \/ TokensPerUpdate = 0 /\ windows[r][i].end - WindowStart(r, i) = AccumSteps
           \/ TokensPerUpdate > 0 /\ windows[r][i].loss >= TokensPerUpdate
    /\ (\A r \in Ranks : round[r] = round[0]) =>
        /\ \A i \in DOMAIN windows[0] :
            SumOver(Ranks, [r \in Ranks |-> windows[r][i].local]) = windows[0][i].loss
        /\ SumOver(Ranks, window_local) = window_loss[0]

\* A rank pads only once it has nothing left (source dry, window and queue
\* empty), and never in quota mode; its steps are its batches, then pads.
\* With DeterministicArrival, what every rank emits at every step is then
\* independent of the schedule.
PadsOnlyAtEnd ==
    \A r \in Ranks :
        /\ pads[r] > 0 => exhausted[r] /\ buffer[r] = {} /\ ready[r] = <<>>
        /\ Mode = "quota" => pads[r] = 0
        /\ \A t \in DOMAIN step_batches[r] : step_batches[r][t] = {} =>
            \A u \in t .. Len(step_batches[r]) : step_batches[r][u] = {}

\* In deterministic mode a rank has consumed a prefix of its shard (dynamic
\* sharding: no id it holds follows, in the plan, one it still waits for).
DeterministicArrival ==
    Deterministic =>
        \A r \in Ranks : pending[r] # {} =>
            IF Dynamic
            THEN \A i \in buffer[r] \cup UNION {ready[r][t] : t \in DOMAIN ready[r]} :
                    Pos(i) < Pos(PlanFirst(pending[r]))
            ELSE \A i \in Shard[r] \ pending[r] : i < MinOf(pending[r])

\* Checked on small models only: TLC's ENABLED is slow here.
EnabledExact == ProtocolEnabled = ENABLED <<ProtocolNext>>_vars

\* Witnesses that the bounds are tight: a model pins that these are violated.
StepsBelowBound == \A r \in Ranks : steps[r] < StepsBound
RoundsBelowBound == \A r \in Ranks : round[r] < RoundsBound

-----------------------------------------------------------------------------
(* Temporal properties.                                                     *)

Termination == <>AllDone

=============================================================================
