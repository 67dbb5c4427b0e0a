//! What the rows of an imported batch reach in every array of its tree: the items of each
//! array a download moves ([`Cut::range`]) and what those items reach in its buffers and
//! children ([`Found`]), so that a slice moves only its bytes, as the planner cuts
//! devarrow's own slices ([`crate::plan`]; both use the arithmetic of
//! [`crate::slicing`]).
//!
//! What an array reaches depends on values that live on the device: the offsets at the
//! bounds of its items (strings, binaries, lists, maps), its list views, its views (view
//! types), its type ids and offsets (dense unions), its run ends (run-end encoded). They
//! are read back in rounds ([`resolve`]): each round gathers every read that is known to
//! be needed on the device with one batched copy and reads it back with one copy and one
//! wait, then settles what they tell, which gives the children their items, whose reads
//! go into the next round. The first round also reads the sizes at every array's own
//! bounds (`Extent`), which decide most arrays of a batch that is not sliced below its
//! columns: such a batch takes one round. A column sliced by its producer takes one more
//! round per level of nesting whose data it cuts (the `utf8` child of a sliced
//! `list<utf8>`: two); the run ends of a sliced run-end encoded array are searched for the
//! runs covering the slice, [`PROBES`] run ends per round (about `log_64` of the runs
//! rounds). A view type takes two rounds once its items are known: the sizes of its
//! variadic buffers, then its moved views (not read when its buffers hold at most
//! [`VIEWS_READ_WHEN_BUFFERS_EXCEED`] times the views' bytes: they move whole); or, when
//! it has more variadic buffers than moved items ([`SIZES_READ_PER_ITEM`]), its moved
//! views first, then the sizes of only the buffers they point into (none, and no second
//! round, when every moved view is inline).
//!
//! What is read back stays proportional to the slice, however many buffers the arrays
//! have: two offsets per array with offsets, the views of the moved items of list views
//! and view types, the sizes of at most one variadic buffer per moved view, the type ids
//! and offsets of a dense union's moved items when its children hold more items, and a
//! few run ends per round.
//! Everything read is validated before anything is planned from it: offsets out of range
//! of the child, views past their buffers, dense union offsets past their child or type
//! ids no field has, and run ends that do not increase are [`Error::InvalidOffsets`]
//! naming the array.

use arrow_schema::{DataType, UnionMode};
use devarrow_abi::device::{Device, BUFFER_ALIGNMENT};
use devarrow_abi::layout::{has_end_offsets, offset_width, BufferRole};
use devarrow_abi::{Error, Result};

use super::{
    address, bytes, check_offsets, read_back, read_int, run_end_width, settle, Extent, ForeignNode,
    Reads,
};
use crate::slicing;

/// Run ends read per search and round: a search over `R` runs takes about `log_64(R)`
/// rounds, each reading at most this many run ends.
const PROBES: usize = 64;

/// A view type's views are read back (16 bytes each) to cut its variadic buffers when the
/// buffers hold more than this many times the views' bytes (each buffer counted to the
/// next 64 bytes, as the packed image places it); otherwise the buffers move whole,
/// which then costs at most this many times the views' own bytes.
const VIEWS_READ_WHEN_BUFFERS_EXCEED: usize = 4;

/// A view type's variadic buffers have all their sizes read back (8 bytes each) when
/// there are at most this many per moved item, at most half the bytes of the moved
/// views. An array with more buffers (a slice of a column of many small blocks, or of
/// many concatenated batches) has its moved views read first, then the sizes of the
/// buffers they point into only: what is read follows the slice, not the column.
const SIZES_READ_PER_ITEM: usize = 1;

/// The most rounds of reads of one import: far more than any valid tree takes (one per
/// level of nesting, a few per run-end search), a bound so that no input loops.
const MAX_ROUNDS: usize = 4096;

/// What a download moves of one array of an imported tree.
#[derive(Debug, Default)]
pub(super) struct Cut {
    /// The items `l..l + n` of the array (logical: from its own offset) that the batch's
    /// rows reach; known once its parent's cut is (the root's: all its items).
    pub(super) range: Option<(usize, usize)>,
    /// What those items reach, once known.
    pub(super) found: Option<Found>,
    /// The reads that will tell it, in flight; or a run-end search to go on with.
    pending: Option<Pending>,
    /// Whether the children (and dictionary) were given their items.
    reached: bool,
}

/// What the moved items of an array reach in its buffers and children.
#[derive(Debug, Clone)]
pub(super) enum Found {
    /// What the type's layout tells without reading anything (fixed widths, bitmaps,
    /// structs, fixed-size lists, sparse unions, dictionaries), or buffers and children
    /// that move whole (the variadic buffers of views not read back, the children of a
    /// dense union whose items do not cut them).
    Plain,
    /// An array with offsets: the offsets of its first moved item and one past its last,
    /// the data bytes or child items they address.
    Offsets { first: usize, last: usize },
    /// A list view: the child items `lo..hi` its moved views address.
    ListView { lo: usize, hi: usize },
    /// A view type: the byte ranges its moved views reach in its variadic buffers
    /// ([`slicing::view_pieces`]: sorted, disjoint, none for a buffer no view reaches),
    /// which are packed one after another.
    Views(Vec<slicing::ViewPiece>),
    /// A dense union: per child, the items `lo..hi` its moved items reach.
    Union(Vec<(usize, usize)>),
    /// A run-end encoded array: the runs `first..last` covering its moved items.
    Runs { first: usize, last: usize },
}

/// Reads in flight for one array: where their bytes land in the round's scratch.
#[derive(Debug)]
enum Pending {
    Offsets {
        at: [usize; 2],
    },
    ListView {
        offsets: usize,
        sizes: usize,
        from: usize,
        count: usize,
    },
    Views {
        at: usize,
        count: usize,
    },
    /// The sizes of variadic buffers of a view type, as runs of consecutive buffers
    /// `(first, count, where in the scratch)`: of every buffer (`views`: `None`), or of
    /// those the moved views, read already, point into.
    Sizes {
        runs: Vec<(usize, usize, usize)>,
        views: Option<Vec<u8>>,
    },
    /// The moved views of a view type, read back, waiting for the sizes of `buffers`
    /// (sorted, distinct: those they point into) to be read in the next round.
    SizesOf {
        views: Vec<u8>,
        buffers: Vec<usize>,
    },
    Union {
        type_ids: usize,
        offsets: usize,
        count: usize,
    },
    Runs(RunSearch),
}

/// Where the moved items `l..l + n` of an array lie in its buffers.
#[derive(Debug, Clone, Copy)]
pub(super) struct Bounds {
    /// The first item, physically (after the array's own offset).
    pub(super) p: usize,
    /// Where its buffers are cut: `p`, or for arrays with a bitmap (bitmaps are cut at
    /// byte boundaries) up to 7 items earlier.
    pub(super) base: usize,
    /// The items from `base` to the last moved one.
    pub(super) m: usize,
}

/// The [`Bounds`] of items `l..l + n` of `node` (inside its length: checked when its
/// range was set).
pub(super) fn bounds(node: &ForeignNode, l: usize, n: usize) -> Bounds {
    let p = node.offset + l;
    let base = if node.has_validity() || node.data_type == DataType::Boolean {
        p & !7
    } else {
        p
    };
    Bounds {
        p,
        base,
        m: n + (p - base),
    }
}

/// Finds what a download of `root` moves in every array of the tree: reads the sizes at
/// the arrays' own bounds (`own_reads`, gathered by `walk`) and what the batch's rows
/// reach, in rounds of one batched gather and one read-back each, until every array's
/// [`Cut`] is found.
pub(super) fn resolve(device: &dyn Device, root: &mut ForeignNode, own_reads: Reads) -> Result<()> {
    reach(root, 0, root.length)?;
    let mut reads = own_reads;
    for round in 0..MAX_ROUNDS {
        // From the second round on, the sizes at the arrays' own bounds are known.
        let own = round > 0;
        schedule(root, &mut reads, own, "array")?;
        if own && reads.is_empty() {
            return Ok(());
        }
        let bytes = read_back(device, &reads)?;
        if !own {
            settle(root, &bytes, "array")?;
        }
        settle_cut(root, &bytes, "array")?;
        reads = Reads::default();
    }
    Err(Error::InvalidArgument(format!(
        "what the batch's rows reach was not found in {MAX_ROUNDS} read-backs"
    )))
}

/// Gives `node` its moved items `l..l + n`, checked against its length.
fn reach(node: &mut ForeignNode, l: usize, n: usize) -> Result<()> {
    if l.checked_add(n).is_none_or(|e| e > node.length) {
        return Err(Error::InvalidArgument(format!(
            "items {l}..{l}+{n} of an array of length {}",
            node.length
        )));
    }
    node.cut.range = Some((l, n));
    Ok(())
}

/// For every array under `node` whose items are known but not what they reach: adds the
/// reads that tell to `reads`, or records what they reach when nothing needs reading; and
/// gives the children of every array whose reach is known their items. `own`: whether the
/// sizes at the arrays' own bounds were read back (some arrays wait for them).
fn schedule(node: &mut ForeignNode, reads: &mut Reads, own: bool, path: &str) -> Result<()> {
    let Some((l, n)) = node.cut.range else {
        return Ok(());
    };
    if node.cut.found.is_none() {
        node.cut.pending = match node.cut.pending.take() {
            // Every other read in flight was settled before this round.
            Some(Pending::Runs(search)) => Some(Pending::Runs(search.probe(node, reads)?)),
            Some(Pending::SizesOf { views, buffers }) => Some(Pending::Sizes {
                runs: read_sizes(node, &buffers, reads)?,
                views: Some(views),
            }),
            Some(pending) => Some(pending),
            None => start(node, l, n, reads, own, path)?,
        };
    }
    if node.cut.found.is_some() && !node.cut.reached {
        reach_children(node, l, n)?;
        node.cut.reached = true;
    }
    for (i, child) in node.children.iter_mut().enumerate() {
        schedule(child, reads, own, &format!("{path}.children[{i}]"))?;
    }
    if let Some(dict) = node.dictionary.as_deref_mut() {
        schedule(dict, reads, own, &format!("{path}.dictionary"))?;
    }
    Ok(())
}

/// Decides what the moved items `l..l + n` of `node` reach: records it when the layout
/// (or the sizes at the node's own bounds) tells, else returns the reads that will tell,
/// added to `reads`; `None` with nothing recorded when the node waits for its own sizes.
fn start(
    node: &mut ForeignNode,
    l: usize,
    n: usize,
    reads: &mut Reads,
    own: bool,
    path: &str,
) -> Result<Option<Pending>> {
    let Bounds { p, base, m } = bounds(node, l, n);
    let dt = node.data_type.clone();
    let unread = || Error::InvalidArgument(format!("the sizes of a {dt} array were not read"));
    let found = match &dt {
        // An empty array with NULL offsets (see devarrow_abi::layout) reaches nothing.
        dt if has_end_offsets(dt) && node.buffers[1] == 0 => Found::Offsets { first: 0, last: 0 },
        dt if has_end_offsets(dt) => {
            if l == 0 && n == node.length {
                // The array's own bounds: read with the sizes at its own bounds.
                if !own {
                    return Ok(Some(Pending::Offsets {
                        at: [node.reads[0], node.reads[1]],
                    }));
                }
                let Extent::Offsets { first, last } = node.extent else {
                    return Err(unread());
                };
                Found::Offsets { first, last }
            } else {
                let w = offset_width(dt);
                let at = [
                    reads.push(address(node.buffers[1], bytes(p, w)?)?, w)?,
                    reads.push(address(node.buffers[1], bytes(p + n, w)?)?, w)?,
                ];
                return Ok(Some(Pending::Offsets { at }));
            }
        }
        DataType::ListView(_) | DataType::LargeListView(_) => {
            if m == 0 {
                Found::ListView { lo: 0, hi: 0 }
            } else {
                let w = offset_width(&dt);
                let (from, len) = (bytes(base, w)?, bytes(m, w)?);
                return Ok(Some(Pending::ListView {
                    offsets: reads.push(address(node.buffers[1], from)?, len)?,
                    sizes: reads.push(address(node.buffers[2], from)?, len)?,
                    from: base,
                    count: m,
                }));
            }
        }
        DataType::Utf8View | DataType::BinaryView => {
            let count = node.variadic_count();
            let read_views = |reads: &mut Reads| -> Result<Option<Pending>> {
                let at = reads.push(address(node.buffers[1], bytes(base, 16)?)?, bytes(m, 16)?)?;
                Ok(Some(Pending::Views { at, count: m }))
            };
            match &node.extent {
                _ if m == 0 || count == 0 => Found::Views(Vec::new()),
                // Every buffer's size, read in the round before (below): cut them or move
                // them whole.
                Extent::Variadic(sizes) => {
                    let held = sizes.iter().fold(0usize, |t, &(_, s)| {
                        let placed = s.checked_next_multiple_of(BUFFER_ALIGNMENT);
                        t.saturating_add(placed.unwrap_or(usize::MAX))
                    });
                    if sizes.iter().all(|&(_, s)| s == 0) {
                        Found::Views(Vec::new())
                    } else if bytes(m, 16 * VIEWS_READ_WHEN_BUFFERS_EXCEED)? < held {
                        return read_views(reads);
                    } else {
                        Found::Plain
                    }
                }
                _ if count <= m.saturating_mul(SIZES_READ_PER_ITEM) => {
                    let all: Vec<usize> = (0..count).collect();
                    return Ok(Some(Pending::Sizes {
                        runs: read_sizes(node, &all, reads)?,
                        views: None,
                    }));
                }
                // More buffers than moved items: the views first, then the sizes of the
                // buffers they point into.
                _ => return read_views(reads),
            }
        }
        DataType::Union(_, UnionMode::Dense) => {
            let items = node
                .children
                .iter()
                .fold(0usize, |t, c| t.saturating_add(c.length));
            if n == 0 {
                Found::Union(vec![(0, 0); node.children.len()])
            } else if n < items {
                return Ok(Some(Pending::Union {
                    type_ids: reads.push(address(node.buffers[0], p)?, n)?,
                    offsets: reads.push(address(node.buffers[1], bytes(p, 4)?)?, bytes(n, 4)?)?,
                    count: n,
                }));
            } else {
                // As many items as the children hold: they are all reached (or the
                // union is malformed, which the host's validation refuses).
                Found::Plain
            }
        }
        DataType::RunEndEncoded(_, _) => {
            let runs = node.children.first().map_or(0, |ends| ends.length);
            if n == 0 {
                Found::Runs { first: 0, last: 0 }
            } else if runs == 0 {
                return Err(Error::InvalidOffsets {
                    path: path.to_string(),
                    message: format!("no run ends for {} items", node.length),
                });
            } else if p == 0 && !own {
                return Ok(None); // waits for its last run end: all its runs may be moved
            } else if p == 0 && matches!(node.extent, Extent::LastRunEnd(e) if e == n as i64) {
                Found::Runs {
                    first: 0,
                    last: runs,
                }
            } else {
                let search = RunSearch::new(p, n, runs);
                match search.found(path)? {
                    Ok(found) => found,
                    Err(search) => return Ok(Some(Pending::Runs(search.probe(node, reads)?))),
                }
            }
        }
        _ => Found::Plain,
    };
    node.cut.found = Some(found);
    Ok(None)
}

/// Settles every read in flight under `node` with the read-back `bytes`: validates what
/// was read and records what the moved items reach (or narrows a run-end search).
fn settle_cut(node: &mut ForeignNode, bytes: &[u8], path: &str) -> Result<()> {
    if let Some(pending) = node.cut.pending.take() {
        let bad = |message: String| Error::InvalidOffsets {
            path: path.to_string(),
            message,
        };
        let found = match pending {
            Pending::Offsets { at } => {
                let w = offset_width(&node.data_type);
                let first = read_int(bytes, at[0], w)?;
                let last = read_int(bytes, at[1], w)?;
                let (first, last) = check_offsets(node, first, last, path)?;
                Some(Found::Offsets { first, last })
            }
            Pending::ListView {
                offsets,
                sizes,
                from,
                count,
            } => {
                let w = offset_width(&node.data_type);
                let child_len = node.children[0].length as i64;
                let mut views = Vec::with_capacity(count);
                for i in 0..count {
                    let o = read_int(bytes, offsets + i * w, w)?;
                    let s = read_int(bytes, sizes + i * w, w)?;
                    if o < 0 || s < 0 || o.checked_add(s).is_none_or(|e| e > child_len) {
                        return Err(bad(format!(
                            "list view {} (offset {o}, size {s}) is outside the child \
                             (length {child_len})",
                            from + i
                        )));
                    }
                    views.push((o, s));
                }
                let (lo, hi) = slicing::list_view_range(views.into_iter());
                Some(Found::ListView {
                    lo: lo as usize,
                    hi: hi as usize,
                })
            }
            Pending::Views { at, count } => {
                let views = at
                    .checked_add(16 * count)
                    .and_then(|end| bytes.get(at..end))
                    .ok_or_else(|| Error::InvalidArgument("read-back views are missing".into()))?;
                let buffers = node.variadic_count();
                if matches!(node.extent, Extent::Variadic(_)) {
                    // Every buffer's size is known.
                    let pieces = slicing::view_pieces(views, buffers, |b| node.variadic_size(b));
                    Some(Found::Views(pieces.map_err(bad)?))
                } else {
                    let buffers = slicing::referenced_buffers(views, buffers).map_err(bad)?;
                    if buffers.is_empty() {
                        Some(Found::Views(Vec::new())) // every moved view is inline
                    } else {
                        node.cut.pending = Some(Pending::SizesOf {
                            views: views.to_vec(),
                            buffers,
                        });
                        None
                    }
                }
            }
            Pending::Sizes { runs, views } => {
                node.extent = Extent::Variadic(settle_sizes(node, &runs, bytes, path)?);
                match views {
                    Some(views) => {
                        let buffers = node.variadic_count();
                        let pieces =
                            slicing::view_pieces(&views, buffers, |b| node.variadic_size(b));
                        Some(Found::Views(pieces.map_err(bad)?))
                    }
                    // Every buffer's size: the next round decides what to read.
                    None => None,
                }
            }
            Pending::SizesOf { .. } => {
                return Err(Error::InvalidArgument(
                    "the sizes of variadic buffers were not read".into(),
                ))
            }
            Pending::Union {
                type_ids,
                offsets,
                count,
            } => {
                let DataType::Union(fields, _) = &node.data_type else {
                    return Err(Error::InvalidArgument("a union without fields".into()));
                };
                let field_ids: Vec<i8> = fields.iter().map(|(id, _)| id).collect();
                let child_lens: Vec<usize> = node.children.iter().map(|c| c.length).collect();
                let ids = type_ids
                    .checked_add(count)
                    .and_then(|end| bytes.get(type_ids..end))
                    .ok_or_else(|| {
                        Error::InvalidArgument("read-back type ids are missing".into())
                    })?;
                let offsets = (0..count)
                    .map(|i| read_int(bytes, offsets + 4 * i, 4).map(|o| o as i32))
                    .collect::<Result<Vec<i32>>>()?;
                let ranges = slicing::dense_union_ranges(
                    &field_ids,
                    &child_lens,
                    ids.iter().map(|&id| id as i8),
                    offsets.into_iter(),
                )
                .map_err(bad)?;
                Some(Found::Union(ranges))
            }
            Pending::Runs(search) => match search.settle(node, bytes, path)? {
                Ok(found) => Some(found),
                Err(search) => {
                    node.cut.pending = Some(Pending::Runs(search));
                    None
                }
            },
        };
        if found.is_some() {
            node.cut.found = found;
        }
    }
    for (i, child) in node.children.iter_mut().enumerate() {
        settle_cut(child, bytes, &format!("{path}.children[{i}]"))?;
    }
    if let Some(dict) = node.dictionary.as_deref_mut() {
        settle_cut(dict, bytes, &format!("{path}.dictionary"))?;
    }
    Ok(())
}

/// Adds the reads of the sizes of the variadic buffers `buffers` (sorted, distinct) of
/// the view array `node` to `reads`, one per run of consecutive buffers; returns the runs
/// as `(first buffer, buffers, where in the scratch)`.
fn read_sizes(
    node: &ForeignNode,
    buffers: &[usize],
    reads: &mut Reads,
) -> Result<Vec<(usize, usize, usize)>> {
    let sizes = node.buffers[node.buffers.len() - 1];
    let mut runs: Vec<(usize, usize)> = Vec::new();
    for &b in buffers {
        match runs.last_mut() {
            Some((first, count)) if *first + *count == b => *count += 1,
            _ => runs.push((b, 1)),
        }
    }
    runs.into_iter()
        .map(|(first, count)| {
            let at = reads.push(address(sizes, bytes(first, 8)?)?, bytes(count, 8)?)?;
            Ok((first, count, at))
        })
        .collect()
}

/// The sizes read back for `runs` ([`read_sizes`]), validated (not negative; a NULL
/// buffer only where it is empty), as `(buffer, size)` sorted by buffer.
fn settle_sizes(
    node: &ForeignNode,
    runs: &[(usize, usize, usize)],
    bytes: &[u8],
    path: &str,
) -> Result<Vec<(usize, usize)>> {
    let mut sizes = Vec::with_capacity(runs.iter().map(|&(_, count, _)| count).sum());
    for &(first, count, at) in runs {
        for k in 0..count {
            let (b, s) = (first + k, read_int(bytes, at + 8 * k, 8)?);
            if s < 0 {
                return Err(Error::InvalidOffsets {
                    path: path.to_string(),
                    message: format!("variadic buffer {b} has negative size {s}"),
                });
            }
            if s > 0 && node.buffers[2 + b] == 0 {
                return Err(Error::NullBuffer {
                    path: path.to_string(),
                    index: 2 + b,
                    role: BufferRole::Data.name(),
                    bytes: s as usize,
                });
            }
            sizes.push((b, s as usize));
        }
    }
    Ok(sizes)
}

/// Gives the children (and dictionary) of `node`, whose moved items `l..l + n` reach what
/// its [`Found`] says, the items they move.
fn reach_children(node: &mut ForeignNode, l: usize, n: usize) -> Result<()> {
    let Bounds { p, base, m } = bounds(node, l, n);
    let found = node.cut.found.clone().unwrap_or(Found::Plain);
    match (&node.data_type, found) {
        (dt, Found::Offsets { first, last }) if has_end_offsets(dt) => {
            if let Some(child) = node.children.first_mut() {
                reach(child, first, last - first)?;
            }
        }
        (DataType::ListView(_) | DataType::LargeListView(_), Found::ListView { lo, hi }) => {
            reach(&mut node.children[0], lo, hi - lo)?;
        }
        (DataType::FixedSizeList(_, k), _) => {
            let k = usize::try_from(*k).map_err(|_| {
                Error::InvalidArgument(format!("{} has a negative list size", node.data_type))
            })?;
            let (from, items) = (bytes(base, k)?, bytes(m, k)?);
            reach(&mut node.children[0], from, items)?;
        }
        (DataType::Struct(_), _) => {
            for child in &mut node.children {
                reach(child, base, m)?;
            }
        }
        (DataType::Union(_, UnionMode::Sparse), _) => {
            for child in &mut node.children {
                reach(child, p, n)?;
            }
        }
        (DataType::Union(_, UnionMode::Dense), Found::Union(ranges)) => {
            for (child, (lo, hi)) in node.children.iter_mut().zip(ranges) {
                reach(child, lo, hi - lo)?;
            }
        }
        (DataType::Union(_, UnionMode::Dense), _) => {
            for child in &mut node.children {
                reach(child, 0, child.length)?;
            }
        }
        (DataType::RunEndEncoded(_, _), Found::Runs { first, last }) => {
            for child in &mut node.children {
                reach(child, first, last - first)?;
            }
        }
        _ => {}
    }
    if let Some(dict) = node.dictionary.as_deref_mut() {
        // Shared by every slice of the array: moved whole.
        reach(dict, 0, dict.length)?;
    }
    Ok(())
}

/// The search for the runs `first..last` of a run-end encoded array that cover its items
/// `start..start + len` (physical, `len > 0`): two partition points of its run ends
/// ([`slicing::ends_before`], [`slicing::ends_before_end`]), each narrowed down by reading
/// [`PROBES`] run ends per round, or all that are left when no more.
#[derive(Debug)]
struct RunSearch {
    start: usize,
    len: usize,
    /// The first covering run.
    first: Narrowing,
    /// The last covering run (one before `last`).
    last: Narrowing,
}

/// A partition point being narrowed down: it lies in `lo..=hi`.
#[derive(Debug)]
struct Narrowing {
    lo: usize,
    hi: usize,
    /// The run ends read this round: `(run, where in the scratch)`, in run order.
    probes: Vec<(usize, usize)>,
}

impl RunSearch {
    /// A search over `runs > 0` run ends. Run ends increase strictly from at least 1, so
    /// run `i` ends at `i + 1` or later: the run holding item `k` is at most run `k`.
    fn new(start: usize, len: usize, runs: usize) -> Self {
        let narrowing = |hi: usize| Narrowing {
            lo: 0,
            hi: hi.min(runs - 1),
            probes: Vec::new(),
        };
        RunSearch {
            start,
            len,
            first: narrowing(start),
            last: narrowing(start + len - 1),
        }
    }

    /// Adds the reads of this round's probes of both searches to `reads`.
    fn probe(mut self, node: &ForeignNode, reads: &mut Reads) -> Result<Self> {
        let ends = &node.children[0];
        let w = run_end_width(ends).ok_or_else(|| {
            Error::InvalidArgument(format!("run ends of type {}", ends.data_type))
        })?;
        let at = |run: usize| address(ends.buffers[1], bytes(ends.offset + run, w)?);
        for narrowing in [&mut self.first, &mut self.last] {
            let (lo, hi) = (narrowing.lo, narrowing.hi);
            narrowing.probes = if lo == hi {
                Vec::new()
            } else if hi - lo <= PROBES {
                // The run ends left, in one read: the partition point is found.
                let from = reads.push(at(lo)?, bytes(hi - lo, w)?)?;
                (lo..hi).map(|run| (run, from + (run - lo) * w)).collect()
            } else {
                (0..PROBES)
                    .map(|j| lo + j * (hi - lo) / PROBES)
                    .map(|run| Ok((run, reads.push(at(run)?, w)?)))
                    .collect::<Result<_>>()?
            };
        }
        Ok(self)
    }

    /// Narrows both searches with the run ends read back: the runs when both are found,
    /// else the search to go on with. Run ends that do not increase are an error.
    fn settle(
        mut self,
        node: &ForeignNode,
        bytes: &[u8],
        path: &str,
    ) -> Result<std::result::Result<Found, Self>> {
        let bad = |message: String| Error::InvalidOffsets {
            path: path.to_string(),
            message,
        };
        let w = run_end_width(&node.children[0]).unwrap_or(8);
        let read = |probes: &[(usize, usize)]| {
            probes
                .iter()
                .map(|&(run, at)| Ok((run, read_int(bytes, at, w)?)))
                .collect::<Result<Vec<(usize, i64)>>>()
        };
        let (firsts, lasts) = (read(&self.first.probes)?, read(&self.last.probes)?);
        let mut seen: Vec<(usize, i64)> = firsts.iter().chain(&lasts).copied().collect();
        seen.sort_unstable();
        seen.dedup_by_key(|&mut (run, _)| run);
        if let Some(pair) = seen.windows(2).find(|pair| pair[1].1 <= pair[0].1) {
            let ((a, ea), (b, eb)) = (pair[0], pair[1]);
            return Err(bad(format!(
                "run ends do not increase: run {a} ends at {ea}, run {b} at {eb}"
            )));
        }
        let (start, len) = (self.start, self.len);
        self.first
            .narrow(&firsts, |e| slicing::ends_before(e, start));
        self.last
            .narrow(&lasts, |e| slicing::ends_before_end(e, start, len));
        self.found(path)
    }

    /// The runs when both searches are done, else the search to go on with.
    fn found(self, path: &str) -> Result<std::result::Result<Found, Self>> {
        if self.first.lo != self.first.hi || self.last.lo != self.last.hi {
            return Ok(Err(self));
        }
        let (first, last) = (self.first.lo, self.last.lo + 1);
        if first >= last {
            return Err(Error::InvalidOffsets {
                path: path.to_string(),
                message: format!(
                    "run ends do not increase: the runs covering items {}..{} end before \
                     they start (runs {first}..{last})",
                    self.start,
                    self.start + self.len
                ),
            });
        }
        Ok(Ok(Found::Runs { first, last }))
    }
}

impl Narrowing {
    /// Narrows the partition point of `before` (true for the run ends before it) with the
    /// run ends `probes` read (increasing): it lies after the last that is before it, at or
    /// before the first that is not.
    fn narrow(&mut self, probes: &[(usize, i64)], before: impl Fn(i64) -> bool) {
        for &(run, end) in probes {
            if before(end) {
                self.lo = self.lo.max(run + 1);
            } else {
                self.hi = self.hi.min(run);
            }
        }
        // Increasing run ends keep `lo <= hi`; never let a bad read cross them.
        self.hi = self.hi.max(self.lo);
        self.probes.clear();
    }
}
