------------------------------ MODULE DGAPBugs ------------------------------
(***************************************************************************)
(* Deliberately broken variants of DGAP, one rule changed each, selected   *)
(* by the constant Bug.  Every *_bug model in manifest.json checks one     *)
(* property of DGAP against one variant and must produce a counterexample, *)
(* so no property is vacuously true (the habit of MongoDB's *_bug.cfg).    *)
(*                                                                         *)
(* The first ten mirror odb_core/verify/bugs.py (BugVariant values); the others *)
(* break a rule the Python model cannot break without raising.             *)
(* Actions keep DGAP's names so counterexamples read like DGAP traces.     *)
(***************************************************************************)
EXTENDS Naturals, Sequences, FiniteSets

CONSTANTS W, Shard, SampleLen, SampleLoss, SamplePatches, Budget, MaxSamples, MaxPatches,
          CostModel, K, M, Mode, Quota, Deterministic, AccumSteps, TokensPerUpdate, NoValue,
          Dynamic, Plan, Target, Carried, EarlyForm, AnyPlacement, AnyInitialSplit, Bug

VARIABLES phase, exhausted, buffer, ready, steps, pads, round, emitted, contribution,
          window_loss, window_local, windows, pending, inbox, delivered, ledger,
          step_batches, step_counts, cursor, formed, placement

D == INSTANCE DGAP
\* The decision of quota mode, applied in join mode by join-closes-early.
DQ == INSTANCE DGAP WITH Mode <- "quota", Quota <- 0

Bugs == {
    "silent-stop",           \* a rank that runs dry stops without telling the others
    "no-pads",               \* a rank runs only the steps it has real batches for
    "drop-leftovers",        \* the former's leftovers are discarded
    "pad-repeats-batch",     \* a pad step re-emits the round's first real batch
    "form-keeps-window",     \* formed samples stay in the window and form again
    "quota-forgets-ledger",  \* a quota close discards what it holds
    "ignore-budget",         \* the whole window becomes one batch
    "eager-contribute",      \* a rank may enter the collective with nothing formed
    "loss-by-cost",          \* the vector carries cost tokens where loss tokens belong
    "window-by-local",       \* a window closes on the rank's own loss tokens
    "join-closes-early",     \* join mode closes like quota mode: the tail is dropped
    "stale-inbox",           \* a rank consumes the same gathered round twice
    "unbounded-prefetch",    \* prefetch while waiting ignores the window size
    "offer-miscounts",       \* the vector reports samples where tokens belong
    "any-order",             \* deterministic mode takes samples in any order
    "early-pads",            \* join runs max offered steps: ranks pad mid-epoch
    "no-fairness",           \* the specification assumes no fairness
    "deal-overlaps",         \* a rank loads its share of a deal from the cursor on
    "rank-local-placement",  \* each rank splits a deal by its own pricing: any split of
                             \* the deal's count, but not the one the others load
    "rank-local-initial-split"} \* each rank splits the initial prefix by its own
                             \* pricing: any split, but not the one the others start on

ASSUME Bug \in Bugs

Ranks == D!Ranks
Ids == D!Ids
vars == D!vars

\* rank-local-initial-split: each rank r starts on its share of a split s[r] of its
\* own (any of D!InitialSplits), with that split's cursor.
Init ==
    IF Bug = "rank-local-initial-split"
    THEN \E s \in [Ranks -> UNION {D!InitialSplits(c) : c \in D!InitialCursors}] :
            D!InitWith([r \in Ranks |-> D!ShareOf(s[r], r)],
                       [r \in Ranks |-> Cardinality(DOMAIN s[r])])
    ELSE D!Init

Observe(r, i) ==
    CASE Bug = "unbounded-prefetch" ->
            /\ \/ phase[r] = "waiting" /\ ~exhausted[r]
               \/ D!NeedsSample(r)
            /\ i \in pending[r]
            /\ Deterministic => i = D!MinOf(pending[r])
            /\ buffer' = [buffer EXCEPT ![r] = @ \cup {i}]
            /\ pending' = [pending EXCEPT ![r] = @ \ {i}]
            /\ formed' = [formed EXCEPT ![r] = FALSE]
            /\ UNCHANGED <<phase, exhausted, ready, steps, pads, round, emitted,
                           contribution, window_loss, window_local, windows,
                           inbox, delivered, ledger,
                           step_batches, step_counts, cursor, placement>>
      [] Bug = "any-order" ->
            /\ D!NeedsSample(r)
            /\ i \in pending[r]
            /\ buffer' = [buffer EXCEPT ![r] = @ \cup {i}]
            /\ pending' = [pending EXCEPT ![r] = @ \ {i}]
            /\ formed' = [formed EXCEPT ![r] = FALSE]
            /\ UNCHANGED <<phase, exhausted, ready, steps, pads, round, emitted,
                           contribution, window_loss, window_local, windows,
                           inbox, delivered, ledger,
                           step_batches, step_counts, cursor, placement>>
      [] OTHER -> D!Observe(r, i)

Exhaust(r) == D!Exhaust(r)

Form(r) ==
    IF Bug \in {"drop-leftovers", "form-keeps-window", "ignore-budget"}
    THEN /\ D!CanForm(r)
         /\ LET res == D!FormResult(buffer[r], Cardinality(buffer[r]) < K)
            IN CASE Bug = "drop-leftovers" ->
                        /\ ready' = [ready EXCEPT ![r] = @ \o res.batches]
                        /\ buffer' = [buffer EXCEPT ![r] = {}]
                 [] Bug = "form-keeps-window" ->
                        /\ ready' = [ready EXCEPT ![r] = @ \o res.batches]
                        /\ UNCHANGED buffer
                 [] Bug = "ignore-budget" ->
                        /\ ready' = [ready EXCEPT ![r] = Append(@, buffer[r])]
                        /\ buffer' = [buffer EXCEPT ![r] = {}]
         /\ UNCHANGED <<phase, exhausted, steps, pads, round, emitted, contribution,
                        window_loss, window_local, windows, pending, inbox, delivered, ledger,
                           step_batches, step_counts, cursor, formed, placement>>
    ELSE D!Form(r)

Contribute(r) ==
    IF Bug \in {"silent-stop", "eager-contribute", "offer-miscounts", "loss-by-cost"}
    THEN /\ \/ D!CanContribute(r)
            \/ Bug = "eager-contribute" /\ phase[r] = "filling" /\ D!NeedsSample(r)
         /\ LET o == D!Offer(r)
                c == CASE Bug = "offer-miscounts" -> [o EXCEPT !.tokens = o.samples]
                       [] Bug = "loss-by-cost" -> [o EXCEPT !.loss_tokens = o.tokens]
                       [] OTHER -> o
            IN /\ contribution' = [contribution EXCEPT ![r] = c]
               /\ phase' = [phase EXCEPT ![r] =
                    IF Bug = "silent-stop" /\ c.final /\ c.offered = 0 THEN "done" ELSE "waiting"]
         /\ UNCHANGED <<exhausted, buffer, ready, steps, pads, round, emitted,
                        window_loss, window_local, windows, pending, inbox, delivered, ledger,
                           step_batches, step_counts, cursor, formed, placement>>
    ELSE D!Contribute(r)

AllGather == D!AllGather

\* early-pads: every round runs the largest offer, so ranks with fewer batches
\* pad although they will have more later.
DecideMax(g) ==
    LET k == D!MaxOf({g[r].offered : r \in Ranks})
        Column(t, field) ==
            LET S == {r \in Ranks : t <= g[r].offered}
            IN D!SumOver(S, [r \in S |-> g[r][field][t]])
    IN [steps |-> k, done |-> \A r \in Ranks : g[r].final,
        global_samples |-> [t \in 1 .. k |-> Column(t, "samples")],
        global_tokens |-> [t \in 1 .. k |-> Column(t, "tokens")],
        global_loss_tokens |-> [t \in 1 .. k |-> Column(t, "loss_tokens")]]

\* window-by-local: a window closes once the rank's own loss tokens reach
\* TokensPerUpdate, not the window's global ones (D!FoldSteps otherwise).
LocalStepWindow(w, last) ==
    IF (IF TokensPerUpdate > 0 THEN w.local >= TokensPerUpdate ELSE D!WindowCloses(w)) \/ last
    THEN D!CloseWindow(w) ELSE w

RECURSIVE LocalFoldSteps(_, _, _, _)
LocalFoldSteps(w, d, locals, t) ==
    IF t > d.steps THEN w
    ELSE LocalFoldSteps(LocalStepWindow(D!AddStep(w, d.global_loss_tokens[t], locals[t]),
                                        d.done /\ t = d.steps),
                        d, locals, t + 1)

Windows(r, d, real) ==
    IF Bug = "window-by-local"
    THEN D!CloseAtEnd(LocalFoldSteps(D!WindowState(r), d, D!StepLocals(r, d.steps, real), 1),
                      d.done)
    ELSE D!EmitWindows(r, d, real)

Receive(r) ==
    IF Bug \in {"no-pads", "pad-repeats-batch", "quota-forgets-ledger", "join-closes-early",
                "stale-inbox", "early-pads", "window-by-local", "deal-overlaps",
                "rank-local-placement"}
    THEN
    /\ inbox[r] # NoValue
    /\ \E d \in {CASE Bug = "join-closes-early" -> DQ!Decide(inbox[r], emitted[r])
                  [] Bug = "early-pads" -> DecideMax(inbox[r])
                  [] OTHER -> D!Decide(inbox[r], emitted[r])} :
       \E a \in IF Bug = "rank-local-placement"
                THEN D!Placements(D!SumOver(Ranks, D!DealOf(r, d)))
                ELSE {D!DealOf(r, d)} :
       LET real == D!Min2(d.steps, Len(ready[r]))
           rest == SubSeq(ready[r], real + 1, Len(ready[r]))
           carried == buffer[r] \cup UNION {rest[t] : t \in DOMAIN rest}
           run == IF Bug = "no-pads" THEN real ELSE d.steps
           repeat(i) == IF Bug = "pad-repeats-batch" /\ real >= 1 /\ i \in ready[r][1]
                        THEN d.steps - real ELSE 0
       IN /\ steps' = [steps EXCEPT ![r] = @ + run]
          /\ pads' = [pads EXCEPT ![r] = @ + (run - real)]
          /\ emitted' = [emitted EXCEPT ![r] = @ + D!SumSeq(d.global_samples)]
          /\ round' = [round EXCEPT ![r] = @ + 1]
          /\ contribution' = [contribution EXCEPT ![r] = NoValue]
          /\ inbox' = IF Bug = "stale-inbox" THEN inbox ELSE [inbox EXCEPT ![r] = NoValue]
          /\ delivered' = [i \in Ids |->
                delivered[i] + Cardinality({t \in 1 .. real : i \in ready[r][t]}) + repeat(i)]
          /\ step_batches' = [step_batches EXCEPT ![r] = @ \o D!RunBatches(r, run, real)]
          /\ step_counts' = [step_counts EXCEPT ![r] = @ \o [t \in 1 .. run |-> D!StepCounts(d)[t]]]
          \* (no-pads and pad-repeats-batch fold every decided step, pads too,
          \* as their Python twins do before they drop or rewrite the pads)
          /\ \E w \in {Windows(r, d, real)} :
                /\ window_loss' = [window_loss EXCEPT ![r] = w.loss]
                /\ window_local' = [window_local EXCEPT ![r] = w.local]
                /\ windows' = [windows EXCEPT ![r] = w.windows]
          /\ IF d.done
             THEN /\ phase' = [phase EXCEPT ![r] = "done"]
                  /\ buffer' = [buffer EXCEPT ![r] = {}]
                  /\ ready' = [ready EXCEPT ![r] = <<>>]
                  /\ ledger' = IF Bug = "quota-forgets-ledger" THEN ledger \cup pending[r]
                               ELSE ledger \cup carried \cup pending[r]
                               \cup D!PlanIds(cursor[r], Len(Plan))
                  /\ pending' = [pending EXCEPT ![r] = {}]
                  /\ UNCHANGED cursor
             ELSE /\ phase' = [phase EXCEPT ![r] = "filling"]
                  /\ ready' = [ready EXCEPT ![r] = rest]
                  /\ LET start == IF Bug = "deal-overlaps" THEN cursor[r] ELSE D!SliceStart(r, a)
                     IN pending' = [pending EXCEPT ![r] = @ \cup D!PlanIds(start, start + a[r])]
                  /\ cursor' = [cursor EXCEPT ![r] = @ + D!SumOver(Ranks, a)]
                  /\ UNCHANGED <<buffer, ledger>>
    /\ placement' = D!PlacementAfter(r)
    /\ UNCHANGED <<exhausted, formed>>
    ELSE D!Receive(r)

Terminating == D!Terminating

ProtocolNext ==
    \/ \E r \in Ranks :
        \/ \E i \in Ids : Observe(r, i)
        \/ Exhaust(r)
        \/ Form(r)
        \/ D!FormEarly(r)
        \/ Contribute(r)
        \/ Receive(r)
    \/ AllGather

Next == ProtocolNext \/ Terminating

Fairness == WF_vars(ProtocolNext)

Spec == Init /\ [][Next]_vars /\ Fairness

\* D!ProtocolEnabled is ENABLED <<ProtocolNext>>_vars for every variant whose
\* guards are DGAP's, i.e. all but eager-contribute and unbounded-prefetch.
LiveSpec == Init /\ [][Next]_vars /\ ([]<>(~D!ProtocolEnabled) \/ []<><<ProtocolNext>>_vars)

\* Chosen by the no-fairness model instead of Spec.
UnfairSpec == Init /\ [][Next]_vars

TypeOK == D!TypeOK
StepAlignment == D!StepAlignment
CollectiveAlignment == D!CollectiveAlignment
NoDuplicate == D!NoDuplicate
NoLoss == D!NoLoss
IdentityCoverage == D!IdentityCoverage
QuotaClosure == D!QuotaClosure
BudgetSafety == D!BudgetSafety
BoundedTermination == D!BoundedTermination
TerminationAgreement == D!TerminationAgreement
ExactLossScaling == D!ExactLossScaling
WindowAlignment == D!WindowAlignment
DeterministicArrival == D!DeterministicArrival
PadsOnlyAtEnd == D!PadsOnlyAtEnd
Termination == D!Termination

=============================================================================
