//! What a slice reaches, and how its offsets are rebased once its children are cut: the
//! arithmetic of cutting a slice out of a list view, a dense union, a run-end encoded array
//! or a view array, shared by the planner of arrow-rs arrays ([`crate::plan`], the values
//! at hand on the host), the import of foreign arrays ([`crate::foreign`], the values read
//! back from the device) and the host rebuild of an imported slice ([`crate::transfer::host`]), so
//! that both paths cut a slice the same way.
//!
//! Functions that read foreign values check them and return what is wrong as a message
//! (the caller names the array: `Error::InvalidOffsets`); none panics or indexes out of
//! bounds on any input.

/// Where a byte range of a foreign view array's variadic buffer went in a download
/// (see [`Node::view_ranges`](crate::plan::Node::view_ranges)).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ViewRange {
    /// The foreign variadic buffer the range lies in (its index among them).
    pub buffer: usize,
    /// Where the range starts in that buffer.
    pub from: usize,
    /// The node's variadic buffer it was packed into (its index among them).
    pub packed: usize,
    /// Where it starts there.
    pub to: usize,
}

/// The child range `lo..hi` that list views with `(offset, size)` address: empty views
/// (size 0) address nothing; `(0, 0)` when no view addresses anything.
pub(crate) fn list_view_range(views: impl Iterator<Item = (i64, i64)>) -> (i64, i64) {
    let (lo, hi) = views
        .filter(|&(_, s)| s > 0)
        .fold((i64::MAX, i64::MIN), |(lo, hi), (o, s)| {
            (lo.min(o), hi.max(o.saturating_add(s)))
        });
    if lo > hi {
        (0, 0)
    } else {
        (lo, hi)
    }
}

/// A list view offset rebased for a child cut to start at `lo`: `offset - lo` for a
/// non-empty view, 0 for an empty one (it addresses nothing).
pub(crate) fn rebase_list_view(offset: i64, size: i64, lo: i64) -> i64 {
    if size > 0 {
        offset.wrapping_sub(lo)
    } else {
        0
    }
}

/// The child of each type id of a union (`field_ids`, in child order): `None` for ids no
/// field has (negative ids included).
fn child_of_type_ids(field_ids: &[i8]) -> [Option<usize>; 128] {
    let mut children = [None; 128];
    for (i, &id) in field_ids.iter().enumerate() {
        if let Ok(id) = usize::try_from(id) {
            if let Some(slot) = children.get_mut(id) {
                *slot = Some(i);
            }
        }
    }
    children
}

/// For each child of a dense union (fields with type ids `field_ids`, children of
/// lengths `child_lens`, in child order), the range `lo..hi` of its items that the union
/// items with `type_ids` and `offsets` reach; `(0, 0)` for a child no item reaches.
///
/// An error names the first type id that no field has, or offset outside its child.
pub(crate) fn dense_union_ranges(
    field_ids: &[i8],
    child_lens: &[usize],
    type_ids: impl Iterator<Item = i8>,
    offsets: impl Iterator<Item = i32>,
) -> Result<Vec<(usize, usize)>, String> {
    let children = child_of_type_ids(field_ids);
    let mut ranges = vec![(usize::MAX, 0usize); child_lens.len()];
    for (i, (id, offset)) in type_ids.zip(offsets).enumerate() {
        let child = usize::try_from(id)
            .ok()
            .and_then(|id| children.get(id).copied().flatten())
            .filter(|&c| c < child_lens.len())
            .ok_or_else(|| format!("item {i} has type id {id}, which no field has"))?;
        let len = child_lens[child];
        let at = usize::try_from(offset)
            .ok()
            .filter(|&o| o < len)
            .ok_or_else(|| {
                format!(
                    "item {i} has offset {offset} into child {child} (type id {id}), \
                     outside the child (length {len})"
                )
            })?;
        let range = &mut ranges[child];
        *range = (range.0.min(at), range.1.max(at + 1));
    }
    Ok(ranges
        .into_iter()
        .map(|(lo, hi)| if lo > hi { (0, 0) } else { (lo, hi) })
        .collect())
}

/// Dense union offsets rebased for children cut to start at `bases` (in child order):
/// each offset minus the base of its item's child. Offsets of type ids no field has are
/// kept (the rebuilt array's validation refuses them).
pub(crate) fn rebase_union_offsets<'a>(
    field_ids: &[i8],
    bases: &'a [usize],
    type_ids: impl Iterator<Item = i8> + 'a,
    offsets: impl Iterator<Item = i32> + 'a,
) -> impl Iterator<Item = i32> + 'a {
    let children = child_of_type_ids(field_ids);
    type_ids.zip(offsets).map(move |(id, offset)| {
        let base = usize::try_from(id)
            .ok()
            .and_then(|id| children.get(id).copied().flatten())
            .and_then(|c| bases.get(c).copied())
            .unwrap_or(0);
        // Bases are child lengths, below 2^31 (union offsets are i32).
        offset.wrapping_sub(base as i32)
    })
}

/// The runs `first..last` of a run-end encoded array whose run ends are `ends` (strictly
/// increasing) that cover its logical items `start..start + len` (`first == last` when
/// `len` is 0).
pub(crate) fn covering_runs(ends: &[i64], start: usize, len: usize) -> (usize, usize) {
    let first = ends.partition_point(|&e| ends_before(e, start));
    if len == 0 {
        return (first, first);
    }
    let last = ends.partition_point(|&e| ends_before_end(e, start, len)) + 1;
    (first, last.min(ends.len()))
}

/// Whether a run ending at `end` ends at or before logical item `start` (so it is not
/// among the runs covering a slice from `start`): the predicate of the first covering
/// run, a partition point.
pub(crate) fn ends_before(end: i64, start: usize) -> bool {
    end <= start as i64
}

/// Whether a run ending at `end` ends before the last item of a slice of `len > 0` items
/// from `start`: the predicate of the last covering run (one past the partition point).
pub(crate) fn ends_before_end(end: i64, start: usize, len: usize) -> bool {
    end < (start + len) as i64
}

/// The run ends of runs cut out of a run-end encoded array for its slice of `len` items
/// from logical item `start`: relative to `start`, the last one (which may reach past the
/// slice) clamped to `len`. Offset 0 then applies, as the C data interface lays it out.
pub(crate) fn rebase_run_ends(
    ends: impl Iterator<Item = i64>,
    start: usize,
    len: usize,
) -> impl Iterator<Item = i64> {
    ends.map(move |e| e.wrapping_sub(start as i64).min(len as i64))
}

/// Views (16 bytes each) are inline up to this many bytes; longer ones point into a
/// variadic buffer.
const INLINE_VIEW: usize = 12;

/// The length, buffer index and offset of a 16-byte view that is not inline.
fn outline_view(view: &[u8]) -> Option<(usize, usize, usize)> {
    let word = |at: usize| u32::from_le_bytes([view[at], view[at + 1], view[at + 2], view[at + 3]]);
    let len = word(0) as usize;
    (len > INLINE_VIEW).then(|| (len, word(8) as usize, word(12) as usize))
}

/// The variadic buffers that `views` (16 bytes each) point into, sorted and distinct:
/// those whose sizes a cut needs. An error names the first view into a buffer that does
/// not exist (of `count`).
pub(crate) fn referenced_buffers(views: &[u8], count: usize) -> Result<Vec<usize>, String> {
    let mut buffers = Vec::new();
    for (i, view) in views.chunks_exact(16).enumerate() {
        let Some((_, buffer, _)) = outline_view(view) else {
            continue;
        };
        if buffer >= count {
            return Err(format!(
                "view {i} points into variadic buffer {buffer}, of {count} buffers"
            ));
        }
        // Views in a builder's order point into the same buffer as the view before.
        if buffers.last() != Some(&buffer) {
            buffers.push(buffer);
        }
    }
    buffers.sort_unstable();
    buffers.dedup();
    Ok(buffers)
}

/// A byte range `lo..hi` of variadic buffer `buffer` that views reach.
pub(crate) type ViewPiece = (usize, usize, usize);

/// The byte ranges of the variadic buffers of a view array (`count` of them, buffer `b`
/// of `size(b)` bytes: `None` when unknown) that `views` (16 bytes each) reach, as
/// `(buffer, lo, hi)`: sorted by buffer, then by `lo`; disjoint, and merged where they
/// overlap or touch within a buffer (views of a builder's rows, in order, reach one range
/// per buffer; views that were filtered, taken or sorted reach many). A buffer no view
/// reaches has none: what this returns, and costs, follows the views, not the buffers.
///
/// An error names the first view into a buffer that does not exist or past the end of
/// one (or of one whose size is unknown).
pub(crate) fn view_pieces(
    views: &[u8],
    count: usize,
    size: impl Fn(usize) -> Option<usize>,
) -> Result<Vec<ViewPiece>, String> {
    let mut pieces: Vec<ViewPiece> = Vec::new();
    let mut sorted = true;
    for (i, view) in views.chunks_exact(16).enumerate() {
        let Some((len, buffer, offset)) = outline_view(view) else {
            continue;
        };
        if buffer >= count {
            return Err(format!(
                "view {i} points into variadic buffer {buffer}, of {count} buffers"
            ));
        }
        let size = size(buffer);
        let end = offset
            .checked_add(len)
            .filter(|&end| size.is_some_and(|size| end <= size))
            .ok_or_else(|| match size {
                Some(size) => format!(
                    "view {i} ({len} bytes at {offset}) reaches past the end of variadic \
                     buffer {buffer} ({size} bytes)"
                ),
                None => format!(
                    "view {i} ({len} bytes at {offset}) points into variadic buffer \
                     {buffer}, whose size was not read"
                ),
            })?;
        // Views in order (the common case) extend the last range without sorting.
        match pieces.last_mut() {
            Some(last) if last.0 == buffer && offset >= last.1 && offset <= last.2 => {
                last.2 = last.2.max(end)
            }
            Some(last) => {
                sorted &= (last.0, last.1) < (buffer, offset);
                pieces.push((buffer, offset, end));
            }
            None => pieces.push((buffer, offset, end)),
        }
    }
    if sorted
        && pieces
            .windows(2)
            .all(|w| w[0].0 < w[1].0 || w[0].2 < w[1].1)
    {
        return Ok(pieces); // sorted and disjoint already
    }
    pieces.sort_unstable();
    let mut merged: Vec<ViewPiece> = Vec::with_capacity(pieces.len());
    for (buffer, lo, hi) in pieces {
        match merged.last_mut() {
            Some(last) if last.0 == buffer && lo <= last.2 => last.2 = last.2.max(hi),
            _ => merged.push((buffer, lo, hi)),
        }
    }
    Ok(merged)
}

/// Rewrites `views` (16 bytes each, little-endian) for the bytes they reach, packed into
/// new variadic buffers: `moved` lists each packed range (sorted by foreign buffer, then
/// by where the range started in it). A view that is not inline gets the packed buffer
/// and the offset of its bytes there. An error names the first view whose bytes were not
/// packed (its foreign array changed since its views were read, say): kept, it would
/// point into another buffer than its own.
pub(crate) fn remap_views(views: &mut [u8], moved: &[ViewRange]) -> Result<(), String> {
    for (i, view) in views.chunks_exact_mut(16).enumerate() {
        let Some((len, buffer, offset)) = outline_view(view) else {
            continue;
        };
        let k = moved.partition_point(|r| (r.buffer, r.from) <= (buffer, offset));
        let range = k
            .checked_sub(1)
            .map(|k| moved[k])
            .filter(|r| r.buffer == buffer)
            .ok_or_else(|| {
                format!(
                    "view {i} ({len} bytes at {offset} of variadic buffer {buffer}) reaches \
                     bytes that were not moved"
                )
            })?;
        let remapped = range.to.checked_add(offset - range.from);
        let (Ok(packed), Some(Ok(remapped))) =
            (u32::try_from(range.packed), remapped.map(u32::try_from))
        else {
            return Err(format!("view {i} is remapped past 32-bit offsets"));
        };
        view[8..12].copy_from_slice(&packed.to_le_bytes());
        view[12..16].copy_from_slice(&remapped.to_le_bytes());
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn view(len: u32, buffer: u32, offset: u32) -> [u8; 16] {
        let mut v = [0u8; 16];
        v[0..4].copy_from_slice(&len.to_le_bytes());
        v[8..12].copy_from_slice(&buffer.to_le_bytes());
        v[12..16].copy_from_slice(&offset.to_le_bytes());
        v
    }

    #[test]
    fn list_views_reach_the_range_of_their_non_empty_views() {
        assert_eq!(
            list_view_range([(5, 2), (9, 0), (1, 3)].into_iter()),
            (1, 7)
        );
        assert_eq!(list_view_range([(5, 0)].into_iter()), (0, 0));
        assert_eq!(rebase_list_view(5, 2, 1), 4);
        assert_eq!(rebase_list_view(9, 0, 1), 0);
    }

    #[test]
    fn dense_unions_reach_a_range_per_child() {
        let ids = [5i8, 7];
        let ranges =
            dense_union_ranges(&ids, &[10, 4], [7, 7, 5].into_iter(), [3, 1, 6].into_iter());
        assert_eq!(ranges.unwrap(), vec![(6, 7), (1, 4)]);
        let none = dense_union_ranges(&ids, &[10, 4], [5].into_iter(), [2].into_iter());
        assert_eq!(none.unwrap(), vec![(2, 3), (0, 0)]);
        let past = dense_union_ranges(&ids, &[10, 4], [7].into_iter(), [4].into_iter());
        assert!(past.unwrap_err().contains("outside the child (length 4)"));
        let negative = dense_union_ranges(&ids, &[10, 4], [7].into_iter(), [-1].into_iter());
        assert!(negative.is_err());
        let unknown = dense_union_ranges(&ids, &[10, 4], [6].into_iter(), [0].into_iter());
        assert!(unknown.unwrap_err().contains("type id 6"));
        let rebased: Vec<i32> =
            rebase_union_offsets(&ids, &[6, 1], [7, 7, 5].into_iter(), [3, 1, 6].into_iter())
                .collect();
        assert_eq!(rebased, vec![2, 0, 0]);
    }

    #[test]
    fn runs_covering_a_slice() {
        let ends = [2i64, 3, 6, 10];
        assert_eq!(covering_runs(&ends, 0, 10), (0, 4));
        assert_eq!(covering_runs(&ends, 2, 1), (1, 2));
        assert_eq!(covering_runs(&ends, 3, 4), (2, 4));
        assert_eq!(covering_runs(&ends, 5, 0), (2, 2));
        let rebased: Vec<i64> = rebase_run_ends(ends[2..4].iter().copied(), 3, 4).collect();
        assert_eq!(rebased, vec![3, 4]);
    }

    #[test]
    fn views_reach_pieces_of_their_buffers() {
        let views: Vec<u8> = [
            view(20, 1, 100),
            view(3, 0, 0),
            view(13, 1, 40),
            view(30, 0, 7),
            view(14, 1, 53),
            view(15, 1, 70),
        ]
        .concat();
        let sizes = [37, 120, 5];
        let pieces = view_pieces(&views, 3, |b| sizes.get(b).copied()).unwrap();
        assert_eq!(
            pieces,
            vec![(0, 7, 37), (1, 40, 67), (1, 70, 85), (1, 100, 120)]
        );
        assert_eq!(referenced_buffers(&views, 3).unwrap(), vec![0, 1]);
        assert!(view_pieces(&views, 2, |b| [36, 120].get(b).copied())
            .unwrap_err()
            .contains("past the end"));
        assert!(view_pieces(&views, 1, |b| [37].get(b).copied())
            .unwrap_err()
            .contains("of 1 buffers"));
        assert!(referenced_buffers(&views, 1)
            .unwrap_err()
            .contains("of 1 buffers"));
        assert!(view_pieces(&views, 3, |b| (b == 1).then_some(120))
            .unwrap_err()
            .contains("was not read"));
        // Views in order, over many buffers: one range each, as they come.
        let ordered: Vec<u8> = (0..50u32).flat_map(|b| view(20, b, 0)).collect();
        let pieces = view_pieces(&ordered, 50, |_| Some(20)).unwrap();
        assert_eq!(pieces, (0..50).map(|b| (b, 0, 20)).collect::<Vec<_>>());
        // Inline views reach nothing.
        let inline: Vec<u8> = [view(12, 9, 9), view(0, 0, 0)].concat();
        assert_eq!(view_pieces(&inline, 0, |_| None).unwrap(), vec![]);
        assert_eq!(referenced_buffers(&inline, 0).unwrap(), Vec::<usize>::new());

        // Buffer 0's range packed at 0 of packed buffer 0, buffer 1's three after it;
        // the views point into packed buffer 0 (or 1, for the last range).
        let range = |buffer, from, packed, to| ViewRange {
            buffer,
            from,
            packed,
            to,
        };
        let moved = vec![
            range(0, 7, 0, 0),
            range(1, 40, 0, 30),
            range(1, 70, 0, 57),
            range(1, 100, 1, 0),
        ];
        let mut remapped = views.clone();
        remap_views(&mut remapped, &moved).unwrap();
        assert_eq!(
            remapped,
            [
                view(20, 1, 0),
                view(3, 0, 0),
                view(13, 0, 30),
                view(30, 0, 0),
                view(14, 0, 43),
                view(15, 0, 57),
            ]
            .concat()
        );
        let mut unmoved = views.clone();
        let err = remap_views(&mut unmoved, &moved[1..]).unwrap_err();
        assert!(
            err.contains("view 3 (30 bytes at 7 of variadic buffer 0)"),
            "{err}"
        );
    }
}
