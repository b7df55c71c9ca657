// Command kneeplot draws the knee of the outbox's pipeline: the latency
// from an order's commit to its reservation against the rate the warehouse
// applied orders, as BenchmarkKnee (natsbroker's knee_test.go) printed them,
// one line for each configuration, the median dashed and the 99th
// percentile solid, on a logarithmic scale.
//
// Usage:
//
//	kneeplot knee.txt knee.png
//
// It is a module of its own so that the outbox's modules need no plotting
// library; make knee runs it.
package main

import (
	"bufio"
	"fmt"
	"image/color"
	"os"
	"regexp"
	"slices"
	"strconv"
	"strings"

	"gonum.org/v1/plot"
	"gonum.org/v1/plot/plotter"
	"gonum.org/v1/plot/vg"
	"gonum.org/v1/plot/vg/draw"
)

func main() {
	if len(os.Args) != 3 {
		fmt.Fprintln(os.Stderr, "usage: kneeplot knee.txt knee.png")
		os.Exit(2)
	}
	if err := run(os.Args[1], os.Args[2]); err != nil {
		fmt.Fprintln(os.Stderr, "kneeplot:", err)
		os.Exit(1)
	}
}

// step is one rate of one configuration.
type step struct {
	applied, p50, p99 float64 // orders a second, milliseconds
}

// line matches a result line: the configuration, then the metrics.
var line = regexp.MustCompile(`^BenchmarkKnee/(\S+)/rate=\d+-\d+\s+\d+\s+\d+ ns/op\s+(.*)$`)

// read returns each configuration's steps, in the file's order, and the
// cpu the file names.
func read(path string) (configs []string, steps map[string][]step, cpu string, err error) {
	f, err := os.Open(path)
	if err != nil {
		return nil, nil, "", err
	}
	defer f.Close()
	steps = map[string][]step{}
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		text := sc.Text()
		if c, ok := strings.CutPrefix(text, "cpu: "); ok {
			cpu = strings.TrimSpace(c)
			continue
		}
		m := line.FindStringSubmatch(text)
		if m == nil {
			continue
		}
		metrics := map[string]float64{}
		fields := strings.Fields(m[2])
		for i := 0; i+1 < len(fields); i += 2 {
			v, err := strconv.ParseFloat(fields[i], 64)
			if err != nil {
				return nil, nil, "", fmt.Errorf("%s: %q: %w", path, text, err)
			}
			metrics[fields[i+1]] = v
		}
		if !slices.Contains(configs, m[1]) {
			configs = append(configs, m[1])
		}
		steps[m[1]] = append(steps[m[1]], step{metrics["applied/s"], metrics["p50-ms"], metrics["p99-ms"]})
	}
	if err := sc.Err(); err != nil {
		return nil, nil, "", err
	}
	if len(configs) == 0 {
		return nil, nil, "", fmt.Errorf("%s: no BenchmarkKnee results", path)
	}
	return configs, steps, cpu, nil
}

func run(in, out string) error {
	configs, steps, cpu, err := read(in)
	if err != nil {
		return err
	}
	p := plot.New()
	p.Title.Text = "Commit to reservation against orders applied, " + cpu
	p.X.Label.Text = "orders applied a second"
	p.Y.Label.Text = "milliseconds (median dashed, 99th percentile solid)"
	p.Y.Scale = plot.LogScale{}
	p.Y.Tick.Marker = plot.LogTicks{Prec: -1}
	p.Legend.Top, p.Legend.Left = true, true
	palette := []color.Color{
		color.RGBA{0x1f, 0x77, 0xb4, 0xff}, color.RGBA{0xd6, 0x27, 0x28, 0xff}, color.RGBA{0x2c, 0xa0, 0x2c, 0xff},
		color.RGBA{0x94, 0x67, 0xbd, 0xff}, color.RGBA{0xff, 0x7f, 0x0e, 0xff}, color.RGBA{0x8c, 0x56, 0x4b, 0xff},
		color.RGBA{0xe3, 0x77, 0xc2, 0xff}, color.RGBA{0x7f, 0x7f, 0x7f, 0xff}, color.RGBA{0xbc, 0xbd, 0x22, 0xff}, color.RGBA{0x17, 0xbe, 0xcf, 0xff},
	}
	for i, config := range configs {
		p50, p99 := make(plotter.XYs, 0), make(plotter.XYs, 0)
		for _, s := range steps[config] {
			p50 = append(p50, plotter.XY{X: s.applied, Y: max(s.p50, 0.01)}) // a log scale has no zero
			p99 = append(p99, plotter.XY{X: s.applied, Y: max(s.p99, 0.01)})
		}
		c := palette[i%len(palette)]
		for _, series := range []struct {
			xys    plotter.XYs
			dashed bool
		}{{p99, false}, {p50, true}} {
			l, points, err := plotter.NewLinePoints(series.xys)
			if err != nil {
				return fmt.Errorf("%s: %w", config, err)
			}
			l.Color, points.Color, points.Shape = c, c, draw.CircleGlyph{}
			if series.dashed {
				l.Dashes = []vg.Length{vg.Points(4), vg.Points(3)}
			} else {
				p.Legend.Add(strings.ReplaceAll(config, "/", ", "), l, points)
			}
			p.Add(l, points)
		}
	}
	p.Add(plotter.NewGrid())
	return p.Save(9*vg.Inch, 5.5*vg.Inch, out)
}
